"""medfl: plugin-based federated learning for medical imaging on MONAI and PyTorch."""

from __future__ import annotations

from medfl.context import ClientContext
from medfl.hookspecs import PLUGIN_API_VERSION, hookimpl
from medfl.messages import Instruction, PayloadError, Reply
from medfl.method import Federation, Method, MethodConfigError, OwnDp, Preset

__version__ = "0.1.0"

__all__ = ["hookimpl", "Instruction", "Reply", "PayloadError", "Federation", "Method", "MethodConfigError", "Preset",
           "OwnDp", "ClientContext", "PLUGIN_API_VERSION", "__version__"]
