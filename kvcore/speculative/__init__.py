"""Speculative decoding with compressed KV, in batches, with per-row rollback."""

from . import draft_model, prompt_lookup  # noqa: F401  (register the providers)
from .accept import Verdict, accept_greedy, accept_sampled, sampling_probs
from .draft_model import ModelDraft, check_same_tokenizer
from .drafts import DraftProvider, Proposal, SpecOptions, draft_for_job, draft_names, make_draft, register_draft
from .engine import SpecEngine
from .prompt_lookup import PromptLookup, lookup
from .rows import RollbackError
from .stats import SpecStats

__all__ = ["DraftProvider", "ModelDraft", "PromptLookup", "Proposal", "RollbackError", "SpecEngine", "SpecOptions",
           "SpecStats", "Verdict", "accept_greedy", "accept_sampled", "check_same_tokenizer", "draft_for_job",
           "draft_names", "lookup", "make_draft", "register_draft", "sampling_probs"]
