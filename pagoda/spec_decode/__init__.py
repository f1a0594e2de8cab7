"""Speculative decoding: proposers that draft tokens, verified in one target forward.

``build_proposer`` turns a SpeculativeConfig into a proposer for the model runner;
the scheduler reserves 1 + k slots per decoding request, the runner fills k with
drafts, the target verifies them (pagoda/sample/rejection_sampler.py), and the
scheduler rolls back what was rejected.
"""

from __future__ import annotations

from pagoda.lazy import lazy_exports
from pagoda.config.speculative import SpeculativeConfig

__all__ = ["DraftRequest", "ModelDraftProposer", "NgramProposer", "Proposer", "SpeculativeConfig",
           "build_proposer", "check_draft_model", "draft_kv_caches"]

# Everything but the config (pagoda/config/speculative.py) needs torch.
__getattr__ = lazy_exports(__name__, {
    "DraftRequest": "proposer", "ModelDraftProposer": "proposer", "Proposer": "proposer",
    "NgramProposer": "ngram", "build_proposer": "build", "check_draft_model": "build", "draft_kv_caches": "build",
})
