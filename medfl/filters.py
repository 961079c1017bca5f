"""Reply filters: what a client's reply becomes before it leaves the client.

A *filter* transforms the model state a client sends (the reply entries a method lists in
:attr:`medfl.method.Method.reply_state`) at the client, and the coordinator undoes (or
checks) it on arrival, before the method's ``server_update`` sees the reply. A run names a
*chain* of filters in its config::

    "filters": [{"name": "dp_gaussian", "epsilon": 3, "clip": 1.0},
                {"name": "quantize", "bits": 8}]

(``fl.filters`` for every method of an experiment, or ``filters`` in one method's entry),
and a method may add its own in front (:meth:`medfl.method.Method.default_filters`). The
same chain runs in process and over Flower: the coordinator plans it once
(:meth:`Filter.plan`: checks, and derives what must be derived, such as the noise
multiplier for a target epsilon), sends the resolved entries to every client with each
training instruction, each client applies them (:meth:`FilterChain.apply`) after its
update and after the payload check, and the coordinator undoes them in reverse order
(:meth:`FilterChain.undo`). What a filter produces must be tensors and numbers (it travels
in the reply); the Flower wire format carries any such tree.

A filter that works on the *update* (``uses_update``: the returned state minus the state the
client started from, e.g. ``dp_gaussian``, or ``quantize`` with ``update: true``) makes the
whole chain work on updates: the chain subtracts the reference (the instruction entry named in ``reply_state``) before the first
filter and adds it back after the last undo, so the method always receives full states.
A filter whose output is no longer a state dict (``encodes``: ``quantize``) must come last.

A filter that is a differential-privacy release says so (:meth:`Filter.release`); the
engine then records every client's epsilon in ``privacy.csv`` (:mod:`medfl.privacy.ledger`).

Filters are plugins: ``register_filters(register)`` (:mod:`medfl.hookspecs`); a site's
operator approves them like methods (:mod:`medfl.approval`). docs/plugins.md ("Reply
filters") is the guide for writing one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from medfl.messages import PayloadError
from medfl.method import Configurable, Federation, Method, MethodConfigError
from medfl.privacy.declared import Release
from medfl.seeding import derive_noise_seed, derive_seed

__all__ = ["Filter", "FilterChain", "FilterContext", "FilterConfigError", "FilterMismatchError", "Release",
           "parameter_keys", "float_buffer_keys", "trainable_count", "configured_filters"]

State = dict[str, torch.Tensor]


class FilterConfigError(MethodConfigError):
    """A filter chain cannot work with this run: unknown filter, bad parameter, wrong order,
    or a method whose reply has no model state to filter."""


class FilterMismatchError(FilterConfigError):
    """A valid chain that one method cannot take: its reply carries no model state, or no
    reference state for an update filter (``fl.filters`` then skips that method)."""


_MODEL_KEYS: dict[str, tuple[list[str], list[str], int]] = {}


def _model_keys(model_spec: dict[str, Any]) -> tuple[list[str], list[str], int]:
    """(parameter names, floating-point buffer names, number of trainable parameter values) of
    the model ``model_spec`` builds, in state-dict order; built once per spec and process, on
    the ``meta`` device where the factory allows it (no memory, no random draws)."""
    key = json.dumps(model_spec, sort_keys=True, default=str)
    if key not in _MODEL_KEYS:
        from medfl.models.registry import build_model

        with torch.random.fork_rng(devices=[]):
            try:
                with torch.device("meta"):
                    model = build_model(model_spec)
            except Exception:  # noqa: BLE001 - a factory that cannot build on meta builds normally
                model = build_model(model_spec)
        names = {n for n, _ in model.named_parameters()}
        state = model.state_dict(keep_vars=True)
        _MODEL_KEYS[key] = ([k for k in state if k in names],
                            [k for k, v in state.items() if k not in names and v.is_floating_point()],
                            sum(p.numel() for p in model.parameters() if p.requires_grad))
    params, buffers, count = _MODEL_KEYS[key]
    return list(params), list(buffers), count


def parameter_keys(model_spec: dict[str, Any]) -> list[str]:
    """Names of the parameters (not buffers) of the model ``model_spec`` builds, in state-dict
    order: what ``dp_gaussian`` noises."""
    return _model_keys(model_spec)[0]


def trainable_count(model_spec: dict[str, Any]) -> int:
    """How many trainable parameter values the model ``model_spec`` builds has: the
    coordinates DP-SGD noises at every step."""
    return _model_keys(model_spec)[2]


def float_buffer_keys(model_spec: dict[str, Any]) -> list[str]:
    """Names of the floating-point buffers (BatchNorm running statistics...) of the model
    ``model_spec`` builds: statistics of the data that ``dp_gaussian`` does not noise."""
    return _model_keys(model_spec)[1]


@dataclass
class FilterContext:
    """What a filter knows when it runs on one reply entry (at the client or the coordinator).

    Attributes:
        client_id: the client whose reply this is.
        round: the round; ``step``: the training step within it (0 unless the method chains).
        seed: a seed of (run seed, round, client, step): a filter draws its randomness from
            :meth:`generator`, so the same run gives the same noise in process and over Flower.
        key: the reply-payload key being filtered (e.g. ``"model"``).
        reference: the state the client started from (the instruction entry named in
            ``reply_state``), or ``None`` when the method has none.
        model_spec: the client's model spec.
        where: a readable location for error messages.
        index: the filter's position in the chain (set by the chain).
        noise_key: the site's secret mixed into :meth:`generator` (see
            :attr:`medfl.context.ClientContext.noise_key`); empty at the coordinator and in
            process.
        spec: the running filter's resolved entry (name and parameters, as JSON; set by the
            chain), mixed into :meth:`generator`: a filter asked again with another noise
            multiplier or clip draws other noise, never the same draw at another scale.
    """

    client_id: str
    round: int
    step: int
    seed: int
    key: str
    reference: State | None
    model_spec: dict[str, Any]
    where: str
    index: int = 0
    noise_key: str = field(default="", repr=False)
    spec: str = ""

    def generator(self, tag: str = "") -> torch.Generator:
        """A CPU generator seeded by a 63-bit seed of (seed, filter position, the filter's
        resolved entry, reply key, ``tag``, the site's noise key): draw every random number
        of a filter from it."""
        from medfl.privacy.gaussian import noise_generator

        return noise_generator(derive_noise_seed(self.seed, "filter", self.index, self.spec, self.key, tag,
                                                 self.noise_key))

    def parameter_keys(self) -> list[str]:
        """The parameter names of the client's model (:func:`parameter_keys`)."""
        return parameter_keys(self.model_spec)


class Filter(Configurable):
    """Base class of reply filters (one subclass per filter; see the module docstring).

    Subclasses set ``name`` and ``description``, take their parameters as keyword arguments
    of ``__init__`` (checked against the config entry like a method's), and implement
    :meth:`apply` (at the client) and :meth:`undo` (at the coordinator).

    Class attributes:
        uses_update: the filter works on the update (returned state minus the state the
            client started from); the method must name that reference in ``reply_state``.
            A filter may set it per instance from a parameter (``quantize``'s ``update``).
        encodes: the filter's output is no longer a state dict (it must be the last filter).
    """

    description: ClassVar[str] = ""
    uses_update: bool = False
    encodes: ClassVar[bool] = False
    _kind: ClassVar[str] = "filter"

    def plan(self, federation: Federation, where: str) -> None:
        """At the coordinator, once, before any training: check the parameters against the
        federation and derive what must be derived (``dp_gaussian``: the noise multiplier
        for a target epsilon over the planned rounds). After it, :meth:`hparams` is the
        resolved entry every client receives. Raise :class:`FilterConfigError` (or
        :class:`medfl.privacy.accounting.PrivacyConfigError`) naming ``where``. Default: nothing."""

    def release(self) -> Release | None:
        """The differential-privacy release one application of this filter makes, for the
        privacy ledger; ``None`` (the default) when the filter is not a DP mechanism."""
        return None

    def apply(self, state: Any, ctx: FilterContext) -> Any:
        """At the client: transform ``state`` (a dict of tensors, or the previous filter's
        output) into what is sent. Must be overridden."""
        raise NotImplementedError(f"filter {self.name!r} does not implement apply")

    def undo(self, value: Any, ctx: FilterContext) -> Any:
        """At the coordinator: turn what :meth:`apply` produced back into what it received,
        checking it (a site may send anything: raise :class:`~medfl.messages.PayloadError`
        naming ``ctx.where``). Must be overridden."""
        raise NotImplementedError(f"filter {self.name!r} does not implement undo")


def _state(value: Any, where: str) -> State:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in value.items()):
        raise PayloadError(f"{where}: expected a dict of tensors (a model state), got {type(value).__name__}")
    return value


class FilterChain:
    """An ordered list of filters applied to the model state of every reply.

    Args:
        filters: the filters, in the order they run at the client.
    """

    def __init__(self, filters: list[Filter]) -> None:
        self.filters = list(filters)

    @classmethod
    def from_specs(cls, specs: Any, where: str = "filters") -> "FilterChain":
        """Build a chain from config entries (``{"name": ..., **parameters}`` or a name).

        Raises:
            FilterConfigError: not a list, an entry without a name, an unknown filter or
                parameter.
        """
        from medfl.plugins import PluginError, lookup

        if specs is None:
            return cls([])
        if not isinstance(specs, list):
            raise FilterConfigError(f"{where}: expected a list of filters like [{{\"name\": \"quantize\", "
                                    f"\"bits\": 8}}], got {specs!r}")
        filters = []
        for i, spec in enumerate(specs):
            spec = {"name": spec} if isinstance(spec, str) else spec
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise FilterConfigError(f"{where}[{i}]: expected a filter name or a dict with a 'name', got {spec!r}")
            try:
                fcls = lookup("filter", spec["name"])
                filters.append(fcls.from_config({k: v for k, v in spec.items() if k != "name"}))
            except (PluginError, TypeError, ValueError) as exc:
                raise FilterConfigError(f"{where}[{i}]: {exc}") from None
        return cls(filters)

    def __bool__(self) -> bool:
        return bool(self.filters)

    def __len__(self) -> int:
        return len(self.filters)

    @property
    def uses_update(self) -> bool:
        """Whether the chain works on updates (some filter has ``uses_update``)."""
        return any(f.uses_update for f in self.filters)

    def specs(self) -> list[dict[str, Any]]:
        """The resolved entries (``{"name": ..., **hparams}``), as sent to the clients."""
        return [{"name": f.name, **f.hparams()} for f in self.filters]

    def releases(self) -> list[Release]:
        """The DP releases one application of the chain makes (one per DP filter)."""
        return [r for r in (f.release() for f in self.filters) if r is not None]

    def check(self, method: type[Method], where: str) -> None:
        """Refuse a chain that cannot work with ``method``: a method whose reply carries no
        model state, a filter after an encoding one, an update filter where the method has
        no reference state, two DP filters.

        Raises:
            FilterConfigError: naming ``where`` and the reason.
        """
        if not self.filters:
            return
        names = ", ".join(f.name for f in self.filters)
        if not method.reply_state:
            raise FilterMismatchError(
                f"{where}: method {method.name!r} sends no model state (its reply_state is empty), so the "
                f"filter(s) {names} have nothing to work on; remove them from this method's entry")
        for i, f in enumerate(self.filters[:-1]):
            if f.encodes:
                raise FilterConfigError(f"{where}[{i}]: filter {f.name!r} encodes the state (its output is not a "
                                        f"model state), so it must be the last filter; got {names}")
        needing = [f.name for f in self.filters if f.uses_update]
        no_ref = sorted(k for k, ref in method.reply_state.items() if ref is None)
        if needing and no_ref:
            raise FilterMismatchError(
                f"{where}: filter(s) {', '.join(needing)} work on the update (returned minus received state), "
                f"but method {method.name!r} sends its reply key(s) {no_ref} without a state it received "
                "(reply_state maps them to None)")
        if len(self.releases()) > 1:
            raise FilterConfigError(f"{where}: more than one differential-privacy filter ({names}); "
                                    "use one mechanism per chain")

    def plan(self, federation: Federation, where: str) -> None:
        """:meth:`Filter.plan` of every filter (at the coordinator, before training)."""
        for i, f in enumerate(self.filters):
            f.plan(federation, f"{where}[{i}] ({f.name})")

    # ------------------------------------------------------------------ the two sides
    def _entries(self, method: type[Method], payload: dict[str, Any], ins_payload: dict[str, Any],
                 **ctx: Any) -> list[FilterContext]:
        out = []
        for key, ref_key in method.reply_state.items():
            if key not in payload:
                continue
            ref = None
            if ref_key is not None and (self.uses_update or ref_key in ins_payload):
                if ref_key not in ins_payload:
                    raise PayloadError(f"{ctx['where']}: filters work on the update of reply key {key!r}, but the "
                                       f"instruction has no {ref_key!r} (the state the client started from)")
                ref = _state(ins_payload[ref_key], f"{ctx['where']} (instruction[{ref_key!r}])")
            out.append(FilterContext(key=key, reference=ref, **{**ctx, "where": f"{ctx['where']}[{key!r}]"}))
        return out

    def check_covered(self, method: type[Method], payload: dict[str, Any], where: str,
                      exempt: frozenset[str] | set[str] = frozenset()) -> None:
        """Refuse a reply that the chain would pass through unfiltered: one that carries
        tensors under keys outside the method's ``reply_state`` (and outside ``exempt``, the
        keys of a declared release) while it lacks a ``reply_state`` key. The filters act
        on ``reply_state`` entries only, so such a reply would leave with nothing clipped,
        noised or quantized while the run records the chain's privacy. A reply with no
        tensors besides exempt ones (a release, a step that sends no state) passes.

        Raises:
            PayloadError: naming the method, the missing keys and the keys sent instead.
        """
        if not self.filters:
            return
        missing = [k for k in method.reply_state if k not in payload]
        others = sorted(k for k in payload if k not in method.reply_state and k not in exempt
                        and _holds_tensor(payload[k]))
        if missing and others:
            names = ", ".join(f.name for f in self.filters)
            raise PayloadError(
                f"{where}: method {method.name!r} names {missing} in reply_state but its reply carries {others} "
                f"instead; the filter(s) {names} act only on reply_state keys, so this reply would leave "
                "unfiltered while the run records their privacy. Reply the model state under "
                f"{missing}, or declare the keys the method sends in its reply_state")

    def apply(self, method: type[Method], payload: dict[str, Any], ins_payload: dict[str, Any], *,
              client_id: str, round: int, step: int, seed: int, model_spec: dict[str, Any],
              where: str, noise_key: str = "", exempt: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
        """At the client: the reply payload with each ``reply_state`` entry filtered
        (``noise_key``: the site's secret, mixed into the filters' random draws; ``exempt``:
        the keys of a declared release, see :meth:`check_covered`).

        Raises:
            PayloadError: an entry is not a state dict, or its reference is missing or
                does not match it, or the reply would leave unfiltered (:meth:`check_covered`).
        """
        if not self.filters:
            return payload
        self.check_covered(method, payload, where, exempt)
        out = dict(payload)
        for ctx in self._entries(method, payload, ins_payload, client_id=client_id, round=round, step=step,
                                 seed=derive_seed(seed, "filters", step), model_spec=model_spec, where=where):
            ctx.noise_key = noise_key
            value: Any = _state(payload[ctx.key], ctx.where)
            if self.uses_update:
                value = _difference(value, ctx.reference, ctx.where)
            for i, f in enumerate(self.filters):
                ctx.index, ctx.spec = i, _entry_key(f)
                value = f.apply(value, ctx)
            out[ctx.key] = value
        return out

    def undo(self, method: type[Method], payload: dict[str, Any], ins_payload: dict[str, Any], *,
             client_id: str, round: int, step: int, seed: int, model_spec: dict[str, Any],
             where: str, exempt: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
        """At the coordinator: the reply payload with every filter undone, in reverse order,
        and the reference added back to updates; the method gets full states (``exempt``:
        as for :meth:`apply`).

        Raises:
            PayloadError: what arrived is not what the chain produces (naming the client,
                the key and the filter), or a reply the chain cannot have filtered
                (:meth:`check_covered`).
        """
        if not self.filters:
            return payload
        self.check_covered(method, payload, where, exempt)
        out = dict(payload)
        for ctx in self._entries(method, payload, ins_payload, client_id=client_id, round=round, step=step,
                                 seed=derive_seed(seed, "filters", step), model_spec=model_spec, where=where):
            value = payload[ctx.key]
            for i in reversed(range(len(self.filters))):
                ctx.index, ctx.spec = i, _entry_key(self.filters[i])
                value = self.filters[i].undo(value, ctx)
            value = _state(value, ctx.where)
            if self.uses_update:
                value = _sum(ctx.reference, value, ctx.where)
            elif ctx.reference is not None:
                _like(value, ctx.reference, ctx.where)
            out[ctx.key] = value
        return out


def _entry_key(f: Filter) -> str:
    """A filter's resolved entry (name and parameters) as canonical JSON, for its seeds."""
    return json.dumps({"name": f.name, **f.hparams()}, sort_keys=True, default=str)


def _holds_tensor(value: Any) -> bool:
    """Whether ``value`` (a payload entry) holds a tensor or array anywhere inside."""
    if isinstance(value, torch.Tensor) or hasattr(value, "__array_interface__"):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _difference(state: State, reference: State | None, where: str) -> State:
    """``state - reference`` for floating-point entries (other entries as they are)."""
    assert reference is not None
    missing = [k for k in state if k not in reference]
    if missing:
        raise PayloadError(f"{where}: the update needs the state the client started from, which lacks "
                           f"{missing[:5]}{'...' if len(missing) > 5 else ''}")
    out = {}
    for k, v in state.items():
        ref = reference[k]
        if tuple(ref.shape) != tuple(v.shape):
            raise PayloadError(f"{where}[{k!r}]: shape {tuple(v.shape)} differs from the received {tuple(ref.shape)}")
        out[k] = (v - ref.to(v.dtype)) if v.is_floating_point() else v
    return out


def _same_keys(state: State, reference: State, where: str, what: str, ordered: bool = False) -> None:
    """Refuse ``state`` (a site's, after the filters' undo) unless it has the reference's keys
    (in its order with ``ordered``)."""
    if (list(state) != list(reference)) if ordered else (set(state) != set(reference)):
        extra = [k for k in state if k not in reference]
        missing = [k for k in reference if k not in state]
        raise PayloadError(f"{where}: the {what}'s keys differ from the state sent to the client "
                           f"(unexpected {extra[:5]}, missing {missing[:5]})")


def _like(state: State, reference: State, where: str) -> None:
    """Check that a decoded state has the keys, shapes and dtypes of the state the client
    was sent (a site may send anything)."""
    _same_keys(state, reference, where, "state", ordered=True)
    for k, ref in reference.items():
        v = state[k]
        if tuple(v.shape) != tuple(ref.shape) or v.dtype != ref.dtype:
            raise PayloadError(f"{where}[{k!r}]: {v.dtype} of shape {tuple(v.shape)}, expected {ref.dtype} of "
                               f"shape {tuple(ref.shape)}")


def _sum(reference: State | None, update: State, where: str) -> State:
    """``reference + update`` in the reference's key order (integer entries as sent); the
    update must hold exactly the reference's keys with its shapes and finite values."""
    assert reference is not None
    _same_keys(update, reference, where, "update")
    out = {}
    for k, ref in reference.items():
        v = update[k]
        if tuple(v.shape) != tuple(ref.shape):
            raise PayloadError(f"{where}[{k!r}]: shape {tuple(v.shape)}, expected {tuple(ref.shape)}")
        if ref.is_floating_point():
            if not v.is_floating_point() or not bool(torch.isfinite(v).all()):
                raise PayloadError(f"{where}[{k!r}]: expected a finite floating-point update, got {v.dtype}"
                                   f"{'' if not v.is_floating_point() else ' with non-finite values'}")
            out[k] = ref + v.to(ref.dtype)
        else:
            out[k] = v.to(ref.dtype)
    return out


def configured_filters(cfg: dict[str, Any], spec: dict[str, Any], method: Method) -> tuple[FilterChain, str]:
    """The filter chain of one method entry of a resolved ``fl`` config, checked against the
    method: its ``default_filters()``, then the entry's own ``filters`` when it has the key
    (``[]`` turns ``fl.filters`` off for it), else ``fl.filters``.

    ``fl.filters`` applies to every method that can take it; a method that cannot (its reply
    carries no model state, like ``local``, whose replies carry metrics only, or no state it
    was sent, for an update filter) runs without it, and the second value says why (the
    run records it). Filters named in the entry itself, or by the method, must apply.

    Raises:
        FilterConfigError: an unknown filter or parameter, a wrong order, or filters the
            entry (or the method) names that the method cannot take.
    """
    own = "filters" in spec
    where = f"method {spec.get('label') or spec['name']!r}: filters" if own else "fl.filters"
    chain = FilterChain.from_specs(list(method.default_filters()) + list(spec["filters"] if own else
                                                                          cfg.get("filters") or []), where)
    try:
        chain.check(type(method), where)
    except FilterMismatchError as exc:
        if own or method.default_filters():
            raise
        return FilterChain([]), str(exc)
    return chain, ""
