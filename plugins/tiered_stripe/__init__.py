"""tiered "stripe" backend: RAID-0 over several member backends (directories on several drives, or
any backend specs), stripes moved concurrently, writes atomic across members."""

from __future__ import annotations

from tiered_stripe.backend import DEFAULT_STRIPE_BYTES, StripeBackend

__all__ = ["DEFAULT_STRIPE_BYTES", "StripeBackend"]
