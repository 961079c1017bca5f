"""The client side: the client steps every transport runs, and the client's state on disk.

:func:`run_client_update`, :func:`run_client_validate` and :func:`run_client_evaluate` are
the transport-independent client steps: the in-process engine and a Flower site both call
them on a :class:`~medfl.context.ClientContext` (defined in :mod:`medfl.context`, beside the
method contract, and re-exported here), so the same checks apply. :class:`ClientStore` keeps
each client's persistent state, versioned by round (:mod:`medfl.engine.store`); the
evaluation steps are in :mod:`medfl.engine.client_eval` (both re-exported here).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from medfl.context import ClientContext
from medfl.engine.client_eval import (_seed_all, build_eval_model, build_final_model,  # noqa: F401
                                      build_peer_model, cross_test_mean, evaluate_final_models, evaluate_model,
                                      run_client_evaluate, score_dataset)
from medfl.engine.store import ClientStore
from medfl.training import NonFiniteError, compute_settings
from medfl.filters import FilterChain
from medfl.guard import ContentGuard
from medfl.messages import RELEASE_CLIP, RELEASE_FLAG, Instruction, PayloadError, Reply, validate_payload
from medfl.method import Method
from medfl.privacy.accounting import PrivacyConfigError
from medfl.privacy.feature_release import RELEASE_METRICS, method_release, perform_release
from medfl.seeding import derive_seed

__all__ = ["ClientStore", "ClientContext", "release_exemptions", "first_non_finite", "run_client_update", "run_client_validate", "run_client_profile", "reported_problem",
           "payload_problem",
           "run_client_evaluate", "build_eval_model", "build_final_model", "evaluate_final_models", "build_peer_model", "evaluate_model", "score_dataset", "cross_test_mean"]


def _check_instruction(instruction: Instruction, what: str, client_id: str) -> None:
    """Check an instruction's payload and config before a client step runs on it."""
    validate_payload(instruction.payload, f"{what} to client {client_id}")
    validate_payload(instruction.config, f"{what} config to client {client_id}")


def first_non_finite(value: Any, path: str = "") -> str:
    """The path of the first floating-point tensor or float in ``value`` (nested dicts,
    lists, tuples) holding NaN or infinity; "" when there is none."""
    if isinstance(value, torch.Tensor):
        return (path or "payload") if value.is_floating_point() and not bool(torch.isfinite(value).all()) else ""
    if isinstance(value, float):
        return (path or "payload") if not math.isfinite(value) else ""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    floats = [k for k, v in value.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
              ] if isinstance(value, dict) and len(value) > 8 else []
    if len(floats) > 8 and len({value[k].device for k in floats}) == 1:
        # a model state: one pass over its floating tensors (a sum is finite only if every
        # value is; a sum that overflows walks them one by one), the per-entry walk only for
        # the rest or to name the culprit. Each tensor is summed where it lies (no copy).
        with torch.no_grad():
            total = torch.stack([value[k].detach().sum().double() for k in floats]).sum()
        if bool(torch.isfinite(total)):
            checked = set(floats)
            items = [(k, v) for k, v in value.items() if k not in checked]
    for k, v in items:
        found = first_non_finite(v, f"{path}[{k!r}]")
        if found:
            return found
    return ""


def release_exemptions(method: Method, instruction: Instruction) -> frozenset[str]:
    """The reply keys of the method's declared per-sample release (:class:`SampleRelease`'s
    feature and label keys) in a reply to ``instruction`` when it asks for the release
    (``config["dp_release"]`` true), else none. They skip the coordinator's shape check
    (the released features are shaped like images) and the filters' coverage check; at the
    client, medfl performs the release on them and the content guard checks what leaves
    (:func:`run_client_update`)."""
    plan = method_release(method)
    if plan is None or instruction.config.get(RELEASE_FLAG) is not True:
        return frozenset()
    return frozenset(plan.keys) | frozenset([plan.labels] if plan.labels else [])


def _perform_release(method: Method, ctx: ClientContext, instruction: Instruction, reply: Reply,
                     where: str) -> frozenset[str]:
    """Medfl's side of a method's per-sample release, on ``reply`` at the client: refuse the
    release's keys in a reply that is no release; in a release, check the reply as the
    method returned it (every key but the labels and, when noise will be added, the
    features), perform the release (:func:`perform_release`: the clip, the noise the plan
    states, drawn with the site's secret) and add medfl's record to the metrics. Returns the
    keys the filters' coverage check leaves to the release (none outside a release).

    Raises:
        PayloadError: a release key outside a release, metrics named like medfl's record,
            client data outside the features, a malformed release.
        PrivacyConfigError: an old-contract method, or a release whose clip the instruction
            should carry and does not.
    """
    plan = method_release(method)
    asked = plan is not None and instruction.config.get(RELEASE_FLAG) is True
    if plan is None or not asked:
        stray = sorted(k for k in (plan.keys if plan is not None else ()) if k in reply.payload)
        if stray:
            raise PayloadError(f"{where}: {stray} carries release {plan.mechanism!r} (a SampleRelease key), which "
                               f"medfl performs only in a reply to an instruction that asks for it (config "
                               f"{RELEASE_FLAG!r}); this reply may not carry it")
        validate_payload(reply.payload, where, allow_str=False, guard=ctx.guard)
        return frozenset()
    taken = sorted(k for k in RELEASE_METRICS if k in reply.metrics)
    if taken:
        raise PayloadError(f"{where} (metrics): {taken} are medfl's record of release {plan.mechanism!r}; the "
                           "method's metrics may not carry these names")
    labels = frozenset([plan.labels] if plan.labels else [])
    # features that will be noised are judged as they leave; unnoised ones as returned too
    validate_payload(reply.payload, where, allow_str=False, guard=ctx.guard,
                     exempt=labels | frozenset(plan.keys) if plan.noised else labels)
    clip = plan.clip
    if math.isnan(clip):
        clip = instruction.config.get(RELEASE_CLIP)
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (math.isfinite(clip) and clip > 0):
            raise PrivacyConfigError(f"{where}: release {plan.mechanism!r} takes its clip from the instruction's "
                                     f"config[{RELEASE_CLIP!r}] (set by the coordinator), a finite number > 0; "
                                     f"got {clip!r}")
    train_labels = ctx.guard.split_labels("train") if isinstance(ctx.guard, ContentGuard) else None
    if train_labels is None:
        raise PayloadError(f"{where}: release {plan.mechanism!r} releases the client's training samples, and "
                           f"client {ctx.client_id} has no train split")
    # the seed names the release (mechanism and every parameter that scales its noise): asked
    # again under other parameters it draws other noise, never the same draw at another scale
    g = torch.Generator().manual_seed(ctx.noise_seed(plan.mechanism, noise_multiplier=plan.noise_multiplier,
                                                     clip=float(clip), delta=plan.delta, noise=plan.noise,
                                                     variance=plan.variance))
    reply.payload, record = perform_release(reply.payload, plan, clip=float(clip), train_labels=train_labels,
                                            generator=g, where=where)
    reply.metrics = {**reply.metrics, **record}
    validate_payload(reply.payload, where + " (as released)", allow_str=False, guard=ctx.guard, exempt=labels)
    return labels | frozenset(plan.keys)


def reported_problem(method: Method, exchange: str, instruction: Instruction, values: dict[str, Any],
                     num_examples: Any = None, train_size: int = 0) -> str:
    """Why an answer in ``exchange`` (``"train"``, ``"validate"``, ``"profile"``) to
    ``instruction`` is not what ``method`` declared before round 1 ("" when it is): a name
    in ``values`` outside :meth:`Method.reported_names`, or (with ``num_examples``) a
    ``num_examples`` other than :meth:`Method.expected_num_examples` for a training split of
    ``train_size``. Names and counts are free channels out of a site (a label per metric
    name, labels encoded in a count); the client checks before its answer leaves, the
    coordinator when it arrives."""
    declared = frozenset(method.reported_names(exchange, instruction))
    if exchange == "train" and instruction.config.get(RELEASE_FLAG) is True and method_release(method) is not None:
        declared |= frozenset(RELEASE_METRICS)   # medfl's own record of the release it performed
    extra = sorted(str(k) for k in values if k not in declared)
    if extra:
        shown = ", ".join(repr(k[:40]) for k in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        return (f"{exchange} value name(s) {shown} that method {method.name!r} does not declare (declared: "
                f"{', '.join(sorted(declared)) or 'none'}); a method declares every name it reports before round 1 "
                f"(Method.{exchange}_metrics or Method.reported_names)")
    if num_examples is not None:
        if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 1:
            return (f"num_examples {num_examples!r:.40} is not an integer >= 1 (a reply's num_examples weighs it in "
                    "the aggregate: 0 would take nothing in, a negative number subtract it)")
        want = int(method.expected_num_examples(instruction, int(train_size)))
        if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples != want:
            return (f"num_examples {num_examples!r:.40} is not the {want} that method {method.name!r} declares for a "
                    f"training split of {int(train_size)} (Method.expected_num_examples)")
    return ""


def payload_problem(method: Method, instruction: Instruction, payload: dict[str, Any]) -> str:
    """Why the payload keys of a reply to ``instruction`` are not the ones ``method``
    declares (:meth:`Method.reply_keys`; "" when they are): a declared key missing (a reply
    with no ``model`` would stop the coordinator's ``server_update`` with a ``KeyError``) or
    another key (an extra tensor, of any size, that nothing expects). The client checks
    before its reply leaves, the coordinator when it arrives."""
    declared = frozenset(method.reply_keys(instruction))
    missing = sorted(str(k) for k in declared if k not in payload)
    extra = sorted(str(k) for k in payload if k not in declared)
    if not missing and not extra:
        return ""
    what = "; ".join(([f"no {', '.join(repr(k) for k in missing)} entr{'y' if len(missing) == 1 else 'ies'}"]
                      if missing else []) +
                     ([f"payload entr{'y' if len(extra) == 1 else 'ies'} "
                       f"{', '.join(repr(k[:40]) for k in extra[:5])}{' ...' if len(extra) > 5 else ''} "
                       "that it does not declare"] if extra else []))
    return (f"{what}: a reply of method {method.name!r} to this instruction carries exactly "
            f"{', '.join(repr(k) for k in sorted(declared)) or 'no payload'} (Method.reply_keys)")


def _keep_state(ctx: ClientContext, store: ClientStore | None) -> None:
    """Check the client's persistent state after a step and save it for the round in
    ``store``; a stateless method (empty state, nothing stored before) writes nothing."""
    validate_payload(ctx.state, f"persistent state of client {ctx.client_id}", allow_str=True)
    if store is not None and (ctx.state or store.has(ctx.client_id)):
        store.save(ctx.client_id, ctx.round, ctx.state)


def run_client_update(method: Method, ctx: ClientContext, instruction: Instruction,
                      store: ClientStore | None = None, filters: FilterChain | None = None,
                      step: int = 0) -> Reply:
    """Check the instruction, run ``method.client_update`` seeded, check the reply, perform
    the method's declared per-sample release when the instruction asks for it
    (:func:`_perform_release`), then apply the run's reply ``filters`` (:mod:`medfl.filters`)
    and check what they produced.

    The content guard (the client's own labels and images, :mod:`medfl.guard`) sees the
    reply as the method returned it (a noised release's features excepted), as released,
    and as it leaves after the filters; its metric names and ``num_examples`` must be what
    the method declares (:func:`reported_problem`; medfl's record of a release is added after).

    With ``store``, the client's persistent state (``ctx.state`` after the update) is saved
    there for this round; a stateless method (empty state, nothing stored before) writes nothing.

    Args:
        step: the training step within the round (``Method.round_steps``), which seeds the
            filters' randomness and every DP draw (``ctx.step``, :meth:`ClientContext.noise_seed`).

    Raises:
        PayloadError: the instruction or reply carries something that may not travel, or
            a metric name or ``num_examples`` the method did not declare.
    """
    _check_instruction(instruction, "instruction", ctx.client_id)
    _seed_all(ctx.seed)
    ctx.step = int(step)
    try:
        with compute_settings(ctx.train, ctx.device):
            reply = method.client_update(ctx, instruction)
    except NonFiniteError as exc:
        raise NonFiniteError(f"client {ctx.client_id}, round {ctx.round}: {exc}") from None
    if not isinstance(reply, Reply):
        raise TypeError(f"method {method.name!r}: client_update must return a Reply, got {type(reply).__name__}")
    where = f"reply of method {method.name!r} from client {ctx.client_id}"
    # the reply, and the whole local model: the layers that stay at the client too (FedBN's norm
    # layers: its reply can be finite while the model it evaluates with is not)
    for what, value in (("the reply's ", reply.payload), ("the client's own state", ctx.state)):
        bad = first_non_finite(value)
        if bad:
            raise NonFiniteError(f"client {ctx.client_id}, round {ctx.round}: {what}{bad} holds NaN or infinite "
                                 "values (training diverged); lower train.lr or set train.clip_grad_norm")
    validate_payload(reply.metrics, where + " (metrics)", allow_str=False, guard=ctx.guard)
    problem = reported_problem(method, "train", instruction, reply.metrics, reply.num_examples,
                               ctx.num_examples("train"))
    if problem:
        raise PayloadError(f"{where}: {problem}")
    exempt = _perform_release(method, ctx, instruction, reply, where)   # the content guard first
    problem = payload_problem(method, instruction, reply.payload)
    if problem:
        raise PayloadError(f"{where}: {problem}")
    if filters:
        reply.payload = filters.apply(type(method), reply.payload, instruction.payload, client_id=ctx.client_id,
                                      round=ctx.round, step=step, seed=ctx.seed, model_spec=ctx.model_spec,
                                      where=where, noise_key=ctx.noise_key, exempt=exempt)
        validate_payload(reply.payload, where + " (after filters)", allow_str=False, guard=ctx.guard,
                         exempt=exempt)
    _keep_state(ctx, store)
    return reply


def run_client_validate(method: Method, ctx: ClientContext, instruction: Instruction,
                        store: ClientStore | None = None) -> dict[str, float]:
    """Check the instruction, run ``method.client_validate`` seeded, check its scalars.

    The validation exchange (:meth:`medfl.method.Method.configure_validate`): what comes
    back is a flat dict of numbers under the names the method declares
    (:func:`reported_problem`), checked like a reply's metrics. With ``store``, the
    client's state is saved again for this round when the method has any.

    Raises:
        PayloadError: the instruction or the result carries something that may not travel.
        TypeError: the result is not a dict of numbers.
    """
    return _scalar_exchange(method, ctx, instruction, store, "validate")


def run_client_profile(method: Method, ctx: ClientContext, instruction: Instruction,
                       store: ClientStore | None = None) -> dict[str, float]:
    """Check the instruction, run ``method.client_profile`` seeded, check its scalars: the
    profile exchange before round 1 (:meth:`medfl.method.Method.configure_profile`),
    checked exactly like the validation exchange (:func:`run_client_validate`)."""
    return _scalar_exchange(method, ctx, instruction, store, "profile")


def _scalar_exchange(method: Method, ctx: ClientContext, instruction: Instruction, store: ClientStore | None,
                     kind: str) -> dict[str, float]:
    _check_instruction(instruction, f"{kind} instruction", ctx.client_id)
    _seed_all(derive_seed(ctx.seed, kind))
    with compute_settings(ctx.train, ctx.device):
        scores = getattr(method, f"client_{kind}")(ctx, instruction)
    where = f"{kind} of method {method.name!r} at client {ctx.client_id}"
    if not isinstance(scores, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in scores.items()):
        raise TypeError(f"{where}: client_{kind} must return a flat dict of numbers, got {scores!r:.200}")
    validate_payload(scores, where, allow_str=False, guard=ctx.guard)
    problem = reported_problem(method, kind, instruction, scores)
    if problem:
        raise PayloadError(f"{where}: {problem}")
    _keep_state(ctx, store)
    return {k: float(v) for k, v in scores.items()}
