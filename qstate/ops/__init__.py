"""Public ops on device tensors: validation, ``torch.library`` registration, launch.

Each op lives in its own module; :mod:`._common` holds the checks they share.
"""

from .conventional import selective_state_update

__all__ = ["selective_state_update"]
