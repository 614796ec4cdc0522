"""The embedded default sentiment model and the generated corpus it is trained on."""

from .corpus import LABELS, Example, generate, token_rationales, write_jsonl
from .default_model import FULL_BUDGET, TrainingBudget, cache_root, default_model_path, load_default_model

__all__ = ["FULL_BUDGET", "LABELS", "Example", "TrainingBudget", "cache_root", "default_model_path", "generate", "load_default_model", "token_rationales", "write_jsonl"]
