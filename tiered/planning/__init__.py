"""Planning: the one memory model (what a config needs on each tier, [Note: one memory model]),
the search for the fastest config that fits ([Note: config search]) and the ZeRO paper's table
beside it ([Note: the ZeRO paper's table]).

Pure arithmetic over module trees and memory sizes; the bandwidth harness is `tiered.bench`.
"""

from __future__ import annotations

from tiered.planning.model_shape import ModelShape, parse_count, shape_from_model
from tiered.planning.search import Memories, Pinned, SearchResult, search

__all__ = [
    "Memories",
    "ModelShape",
    "Pinned",
    "SearchResult",
    "parse_count",
    "search",
    "shape_from_model",
]
