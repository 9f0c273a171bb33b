"""Which site each TP all-reduce of a vLLM model's forward is, at which width, and the pass around
each forward; pure Python over a communicator, no vLLM (echo_tp/vllm/plugin.py connects it).

vLLM's decoder models call their TP group's all-reduce from two kinds of layer: the vocab-parallel
embedding (first, once per forward) and each row-parallel linear that reduces its output
(o_proj and down_proj: two per decoder layer, attention before MLP). A `Schedule`, read once from
the model's modules at load, says what the k-th call of a forward is:

    call 0        the embedding   16 bits (a table lookup summed over the vocab shards: exact)
    call 1 + s    site s          tp.policy.site_width(plan, s, bits=, n_layers=L), the width
                                  the TP engine gives site s (policy, first/last site rules)
    per forward   1 + 2L calls    (2L without a vocab-parallel embedding)

Site 2l is layer l's attention block, 2l + 1 its MLP block, as in the TP engine (tp/sites.py);
the schedule checks the modules agree (the i-th reducing linear lies in layer i // 2).

`PassRouter` runs one TP group's calls. `forward(schedule, fn, ...)` runs one model forward as
one pass (comm.pass_scope: fresh compensator state, site numbering from 0), whatever its batch
holds (prefill, decode or both: vLLM flattens them into one [tokens, hidden] forward).
`all_reduce(x)` sends the pass's next call to the communicator at its width; the communicator
routes it by size and device as it routes any call (collective/routing.py). A call outside any
forward goes to vLLM's own all-reduce, its reason logged once. A forward that makes more calls
than its schedule is refused at the first extra call, one that makes fewer when it returns
(RuntimeError): its sites would be misnumbered.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from echo_tp import envs
from echo_tp.compensator import NormOutput
from echo_tp.tp.plan import SITES_PER_LAYER
from echo_tp.tp.policy import CommSpec, WidthPlan, parse_comm_spec, site_width, telemetry_budget

log = logging.getLogger(__name__)

EMBEDDING, REDUCE = "embedding", "reduce"
"""The kinds of a model's all-reducing modules (Schedule.build's `modules`)."""


def comm_spec(text: str | None = None) -> CommSpec | None:
    """The comm spec of ECHO_VLLM (or `text`): None when unset; ValueError naming the flag for a
    spec tp.policy.parse_comm_spec refuses, and for a telemetry policy (its calibration pass is
    a tool of echo-tp eval, not of a serving engine)."""
    text = envs.vllm_comm() if text is None else text.strip() or None
    if text is None:
        return None
    try:
        spec = parse_comm_spec(text)
        if isinstance(spec.widths.policy, str) and telemetry_budget(spec.widths.policy):
            raise ValueError(f"policy {spec.widths.policy!r} is chosen on a calibration pass, "
                             "which vLLM does not run; pass a fixed policy (early8, ends8, ...)")
    except ValueError as e:
        raise ValueError(f"ECHO_VLLM={text!r}: {e}. ECHO_VLLM takes a comm spec such as "
                         "'echo4', '4', '16' or 'echo4:eta=0' (docs/usage/vllm.md); unset it to "
                         "serve without Echo") from None
    return spec


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """What each TP all-reduce of one model's forward is (the module docstring)."""

    model: str
    """The model's class name (for messages)."""
    n_layers: int
    embedding: bool
    """The first call of a forward is the vocab-parallel embedding's."""
    widths: tuple
    """Per call of a forward: 16 for the embedding, the site's width (None: the config's)."""
    norms: tuple = ()
    """Per call of a forward: the norm its sum passes before the residual add (post-norm
    families, hf/plan.OUTPUT_NORMS), or None; () where no site has one."""

    @classmethod
    def build(cls, *, model: str, modules: Sequence[tuple[str, str]], n_layers: int,
              plan: WidthPlan, bits: int, norms: dict | None = None) -> "Schedule":
        """The schedule of a model whose all-reducing modules are `modules`, (name, kind) in
        registration order (kind EMBEDDING or REDUCE), under the width rules `plan` of a config
        at `bits`; norms: site -> the norm module after it (post-norm families). ValueError,
        with the reason, where the calls cannot be numbered as sites."""
        kinds = [k for _, k in modules]
        reducers = [n for n, k in modules if k == REDUCE]
        embedding = EMBEDDING in kinds
        if kinds.count(EMBEDDING) > 1 or (embedding and kinds[0] != EMBEDDING):
            raise ValueError(f"{model}: expected at most one vocab-parallel embedding, before "
                             f"every reducing linear; got {_names(modules)}")
        if len(reducers) != SITES_PER_LAYER * n_layers:
            raise ValueError(f"{model}: {len(reducers)} reducing row-parallel linears for "
                             f"{n_layers} layers, expected {SITES_PER_LAYER} per layer "
                             f"(attention, MLP): {_names(modules)}")
        for i, name in enumerate(reducers):
            if layer_index(name) != i // SITES_PER_LAYER:
                raise ValueError(f"{model}: reducing linear {i} is {name!r}, expected one in "
                                 f"layer {i // SITES_PER_LAYER} (two per layer, in layer order)")
        resolved = plan.resolved(n_layers)
        sites = tuple(site_width(resolved, s, bits=bits, n_layers=n_layers)
                      for s in range(len(reducers)))
        lead = (None,) if embedding else ()
        per_site = tuple((norms or {}).get(s) for s in range(len(reducers)))
        return cls(model=model, n_layers=n_layers, embedding=embedding,
                   widths=((16,) if embedding else ()) + sites,
                   norms=lead + per_site if any(n is not None for n in per_site) else ())

    @property
    def calls(self) -> int:
        """TP all-reduces per forward."""
        return len(self.widths)

    def site(self, call: int) -> int | None:
        """The site of the forward's call number `call` (None: the embedding)."""
        if not 0 <= call < self.calls:
            raise IndexError(f"call {call} of a {self.calls}-call forward")
        if self.embedding:
            return None if call == 0 else call - 1
        return call


def layer_index(name: str) -> int | None:
    """The layer number in a module path ('model.layers.3.mlp.down_proj' -> 3); None unless
    the path holds exactly one number."""
    found = [part for part in name.split(".") if part.isdigit()]
    return int(found[0]) if len(found) == 1 else None


def _names(modules) -> str:
    names = [n for n, _ in modules]
    return f"{names[:4]}{' ...' if len(names) > 4 else ''} ({len(names)})"


class PassRouter:
    """One TP group's all-reduces through `comm` (an EchoCommunicator over the group), one pass
    per model forward; `fallback` is vLLM's own all-reduce (calls outside any forward)."""

    def __init__(self, comm, fallback: Callable[[torch.Tensor], torch.Tensor]):
        self.comm = comm
        self.fallback = fallback
        self.schedule: Schedule | None = None
        """The schedule of the running forward (None: no forward runs)."""
        self.calls = 0
        """Calls the running forward has made."""
        self._told_outside = False

    def forward(self, schedule: Schedule, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs), a model forward, as one pass of `schedule`'s calls."""
        with self.comm.pass_scope("forward"):
            self.schedule, self.calls = schedule, 0
            try:
                out = fn(*args, **kwargs)
            finally:
                made, self.schedule = self.calls, None
        if made != schedule.calls:
            raise RuntimeError(self._miscount(schedule, str(made)))
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group: the running forward's next call at its width, or
        vLLM's own all-reduce outside a forward. Never x itself (a new tensor)."""
        schedule = self.schedule
        if schedule is None:
            if not self._told_outside:
                self._told_outside = True
                log.warning("echo-tp: a TP all-reduce of shape %s outside a model forward went "
                            "to vLLM's own all-reduce (Echo numbers the calls of a forward; "
                            "this one belongs to none). Logged once", tuple(x.shape))
            return self.fallback(x)
        if self.calls == schedule.calls:
            raise RuntimeError(self._miscount(schedule, f"more than {schedule.calls}"))
        width = schedule.widths[self.calls]
        norm = schedule.norms[self.calls] if schedule.norms else None
        self.calls += 1
        omap = None if norm is None else NormOutput.from_module(norm, x.shape[-1])
        return self.comm.all_reduce(x, bits=width, output_map=omap)

    @staticmethod
    def _miscount(schedule: Schedule, made: str) -> str:
        first = "1 embedding + " if schedule.embedding else ""
        return (f"echo-tp: a forward of {schedule.model} made {made} TP all-reduces; its "
                f"schedule has {schedule.calls} ({first}{SITES_PER_LAYER} per layer x "
                f"{schedule.n_layers} layers), so Echo cannot number its sites. The model has "
                "all-reduces the schedule does not know (mixture-of-experts layers, a vision "
                "tower, ...): echo_tp.vllm does not cover it; unset ECHO_VLLM")
