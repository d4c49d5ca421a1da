"""Llama 3 model family."""

from .flavors import LLAMA3_FLAVORS
from .model import Llama3Args, RopeScaling, Transformer

__all__ = ["LLAMA3_FLAVORS", "Llama3Args", "RopeScaling", "Transformer"]
