"""Op dispatch: `Ops(mode)` for model code, and the torch.library drop-in mode."""

from detinfer.ops.functional import MODES, Ops

__all__ = ["MODES", "Ops"]
