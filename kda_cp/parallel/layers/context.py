"""How a model runs on a sequence sharded over a context-parallel group, set once on its layers.

    ctx = CPContext(group=cp_group, strategy="scan")
    parallelize(model, ctx)          # every KDA, attention and short-conv layer now runs sharded
    logits = model(input_ids_shard)  # collective: every rank of the group calls it in the same order

Layers hold a :class:`CPContext` in their ``cp`` attribute (unsharded by default); nothing about
parallelism is passed through ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from kda_cp.parallel.exchange import group_rank_and_size

__all__ = ["CPContext", "parallelize", "CP_STRATEGIES", "ULYSSES_IMPLS"]

#: "scan": the affine prefix scan over ranks (kda_cp.parallel.cp_chunk_kda); "ulysses": the
#: head-parallel all-to-all (kda_cp.parallel.layers.ulysses; needs num_heads % P == 0 and equal shards).
CP_STRATEGIES = ("scan", "ulysses")
#: The all-to-all behind "ulysses": DeepSpeed's when installed ("auto"), or torch's.
ULYSSES_IMPLS = ("auto", "deepspeed", "torch")


@dataclass(frozen=True)
class CPContext:
    """A context-parallel setting.

    Attributes:
        group: torch.distributed process group of the CP ranks; None (or a group of size 1) for an
            unsharded sequence.
        strategy: how KDA layers run when sharded, one of :data:`CP_STRATEGIES`.
        ulysses_impl: the all-to-all of the "ulysses" strategy, one of :data:`ULYSSES_IMPLS`.

    Raises:
        ValueError: an unknown strategy or ulysses_impl.
    """

    group: object = None
    strategy: str = "scan"
    ulysses_impl: str = "auto"

    def __post_init__(self) -> None:
        if self.strategy not in CP_STRATEGIES:
            raise ValueError(f"CPContext.strategy must be one of {CP_STRATEGIES}, got {self.strategy!r}")
        if self.ulysses_impl not in ULYSSES_IMPLS:
            raise ValueError(f"CPContext.ulysses_impl must be one of {ULYSSES_IMPLS}, got {self.ulysses_impl!r}")

    def __deepcopy__(self, memo):  # a process group is shared, never copied (EMA copies of a model)
        return self

    def __reduce__(self):  # a process group does not pickle: the loaded model must be parallelized again
        return (CPContext, (None if self.group is None else DETACHED, self.strategy, self.ulysses_impl))

    def rank_and_size(self) -> tuple[int, int]:
        """(this rank's index in the group, the group's size); (0, 1) when unsharded.

        Raises:
            ValueError: a context whose group was dropped by pickling (a model saved with
                torch.save while parallelized): it would otherwise run unsharded, silently wrong.
        """
        if self.group is DETACHED:
            raise ValueError("this layer was parallelized when it was pickled, and a process group does not "
                             "pickle: call kda_cp.parallel.parallelize(model, CPContext(group, ...)) after loading "
                             "(or parallelize(model, None) to run it unsharded)")
        return group_rank_and_size(self.group)


class _Detached:
    """The group of a CPContext that was pickled with one (see :meth:`CPContext.rank_and_size`)."""

    def __reduce__(self):
        return "DETACHED"

    def __repr__(self) -> str:
        return "DETACHED"


DETACHED = _Detached()


def parallelize(model: nn.Module, ctx: CPContext | None = None) -> nn.Module:
    """Set ``ctx`` on every submodule of ``model`` that runs differently under CP (those with a
    ``cp`` attribute: KDALayer, AttentionLayer, ShortConv, the peer's layer). None unshards.
    Modules added to ``model`` afterwards keep their own (unsharded) context: parallelize last.
    A deep copy shares the context; a pickled one drops its process group.

    Returns:
        ``model`` (modified in place).
    Raises:
        TypeError: ctx is neither a CPContext nor None.
    """
    if ctx is None:
        ctx = CPContext()
    if not isinstance(ctx, CPContext):
        raise TypeError(f"parallelize takes a CPContext or None, got {type(ctx).__name__}")
    for module in model.modules():
        if isinstance(getattr(module, "cp", None), CPContext):
            module.cp = ctx
    return model
