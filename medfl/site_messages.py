"""A medfl message in, its answer out, at a site (:class:`medfl.site.Site`): what every
backend's site side calls, whatever carried the message (Flower's ClientApp,
:mod:`medfl.flower.proxy`, through :func:`handle`; NVIDIA FLARE's executor,
:mod:`medfl.nvflare.executor`, through :func:`answer_message`).

Everything a coordinator sends is checked before the site acts on it: the control record and
each instruction's config hold no MONAI config syntax (:func:`plain`), the message is of this
protocol, for this client, and names only approved plugins (:meth:`medfl.site.Site.check`).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import nullcontext
from typing import Any

from medfl import wire
from medfl.engine import protocol as P
from medfl.logs import file_log
from medfl.messages import Instruction, PayloadError
from medfl.site import Site, SiteError, SiteSettings
from medfl.wire import Content

__all__ = ["plain", "answer_message", "handle", "handle_locally", "site_for"]

logger = logging.getLogger(__name__)

_SITES: dict[str, Site] = {}


def site_for(node_config: dict[str, Any]) -> Site:
    """The :class:`Site` of a node config (one per process and config)."""
    settings = SiteSettings.from_node_config(node_config)
    key = json.dumps([settings.client_id, str(settings.config), str(settings.state_dir),
                      settings.overrides, str(settings.workdir), settings.device], sort_keys=True)
    if key not in _SITES:
        _SITES[key] = Site(settings)
    return _SITES[key]


def plain(data: Any, where: str) -> None:
    """Refuse MONAI config syntax in what a coordinator sent (:func:`medfl.config_file.refuse_syntax`;
    tensors and other leaves pass): a site runs none of a coordinator's text.

    Raises:
        SiteError: naming ``where`` and the key.
    """
    from medfl.config_file import PlainDataError, refuse_syntax

    try:
        refuse_syntax(data, where, json_only=False)
    except PlainDataError as exc:
        raise SiteError(str(exc)) from None


def _instruction(content: Content, where: str, prefix: str = "ins") -> Instruction:
    config = wire.take(content, f"{prefix}.config", where + " (config)")
    plain(config, where + " (config)")
    return Instruction(payload=wire.take(content, f"{prefix}.payload", where), config=config)


def answer_message(site: Site, message_type: str, content: Content, *, clientapp_age: float | None = None
                   ) -> Content:
    """Answer one medfl message (:mod:`medfl.engine.protocol`) at ``site``, whatever carried it
    (Flower: :func:`handle`; NVIDIA FLARE: :mod:`medfl.nvflare.executor`): check what came in,
    run the step, check what goes out (the answer is built by :mod:`medfl.wire`, as the
    in-process engine builds it to measure it).

    The run's log at the site says how long that took (a DEBUG line ``... answered in S s``)
    and, given ``clientapp_age`` (how long the ClientApp process that forwarded the message had
    run: :func:`medfl.flower.proxy.process_age`), what Flower's start of that process took;
    ``benchmarks/flower_overhead.py`` reads both.

    Raises:
        SiteError: unknown message type, wrong protocol or client id.
        PayloadError: something other than tensors and scalars in or out.
    """
    t0 = time.perf_counter()
    ctl = wire.take_json(content, P.CONTROL, f"message to site {site.client_id}")
    plain(ctl, f"medfl site {site.client_id}: {message_type} message's control record")
    site.check(ctl)
    # the site's own log of the run, beside its state (<state-dir>/<run id>/site_<client id>/log.txt)
    # (a hello names no run yet: it is answered without one)
    with file_log(site._root(ctl), f"site {site.client_id}: {message_type} message, round {ctl.get('round')}") \
            if "run" in ctl else nullcontext(), site.models_guarded(ctl):
        out = _answer(site, message_type, ctl, content)
        logger.debug(f"site {site.client_id}: {message_type} message, round {ctl.get('round')}: answered in "
                     f"{time.perf_counter() - t0:.3f} s" + ("" if clientapp_age is None else
                     f"; its ClientApp process had run {clientapp_age:.3f} s when it forwarded the message"))
        return out


def handle(site: Site, message_type: str, data: bytes, *, clientapp_age: float | None = None) -> bytes:
    """:func:`answer_message` on a message's bytes (:func:`medfl.wire.encode`'s, as the
    ClientApp forwards them, :mod:`medfl.flower.proxy`); the answer's bytes.

    Raises:
        SiteError, PayloadError: as :func:`answer_message`; WireError (a PayloadError): bytes
            that are not a medfl content.
    """
    return wire.encode(answer_message(site, message_type, wire.decode(data), clientapp_age=clientapp_age))


def _answer(site: Site, message_type: str, ctl: dict[str, Any], content: Content) -> Content:
    """:func:`answer_message` once the message's control fields ``ctl`` are read and checked."""
    me = f"site {site.client_id}"
    if message_type == P.HELLO:
        info = site.hello(ctl)
        return wire.answer(site.client_id, sizes=info["sizes"], digest=info["digest"])
    if message_type == P.TRAIN:
        ins = _instruction(content, f"instruction to {me}")
        if ctl.get("secure_aggregation"):
            return site.secure_train(ctl, ins, content)
        payload, n, metrics = site.train(ctl, ins)
        return wire.train_answer(site.client_id, payload, metrics, n)
    if message_type == P.EVALUATE:
        results, state = site.evaluate(ctl, _instruction(content, f"evaluation instruction to {me}"))
        return wire.evaluate_answer(site.client_id, results, state)
    if message_type == P.VALIDATE:
        scores = site.validate(ctl, _instruction(content, f"validation instruction to {me}"))
        return wire.validate_answer(site.client_id, scores)
    if message_type == P.SCORE:
        models = wire.take(content, "models", f"cross_test models sent to {me}")
        if not isinstance(models, dict):
            raise PayloadError(f"cross_test models sent to {me}: expected a dict")
        ins_of = {str(k): int(v) for k, v in dict(ctl.get("ins_of", {})).items()}
        shared = {k: _instruction(content, f"cross_test instruction {k} sent to {me}", prefix=f"ins.{k}")
                  for k in sorted(set(ins_of.values()))}
        results = site.score(ctl, models, {owner: shared[k] for owner, k in ins_of.items()})
        return wire.score_answer(site.client_id, results)
    raise SiteError(f"{me}: unknown message type {message_type!r}")


def handle_locally(node_config: dict[str, Any], message_type: str, data: bytes) -> bytes:
    """:func:`handle` in this process, for the site named by ``node_config``."""
    return handle(site_for(node_config), message_type, data)
