from engine.model.arch import SUPPORTED_ARCHITECTURES, ModelArch
from engine.model.loader import load_model

__all__ = ["ModelArch", "SUPPORTED_ARCHITECTURES", "load_model"]
