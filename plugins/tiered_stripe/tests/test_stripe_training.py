"""Training through a stripe tier over two directories equals plain PyTorch AdamW."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # the engine tests' helpers

from engine_support import (
    CASES,
    REL,
    assert_losses_close,
    assert_params_close,
    build,
    ds_config,
    make_batches,
    reference_train,
    tiered_train,
)


def test_mlp_trains_through_a_stripe_tier_over_two_directories(tmp_path: Path) -> None:
    drives = [tmp_path / "drive0", tmp_path / "drive1"]
    for d in drives:
        d.mkdir()
    cfg = ds_config(param="nvme", opt="nvme", nvme_path=str(tmp_path / "nvme"))
    # an odd stripe far below the partition sizes: every partition is cut over both drives
    cfg["tiered"] = {
        "residency": "off",  # every step through the stripe, nothing kept in cpu memory
        "tiers": {
            "striped": {
                "backend": {
                    "type": "stripe",
                    "stripe_bytes": 1001,
                    "paths": [str(d) for d in drives],
                    "member_options": {"fsync": False},
                }
            }
        },
        "param_tier": "striped",
        "optimizer_tier": "striped",
    }
    case = CASES["mlp"]
    batches = make_batches(case, 3, 4)
    want_losses, want = reference_train(build(case), case, batches)
    got_losses, got, stats = tiered_train(build(case), case, batches, cfg)
    assert_losses_close(got_losses, want_losses)
    assert_params_close(got, want, REL)
    links = stats["tiers"]["links"]
    assert links["striped->cpu"]["bytes"] > 0 and links["cpu->striped"]["bytes"] > 0
    assert all(links[k]["bytes"] == 0 for k in links if "nvme" in k), "offload went to the derived nvme tier"
    for d in drives:  # both drives hold stripes (files named d<generation>x<index>-<key>)
        assert any(p.name.startswith("d") for p in d.iterdir()), f"{d.name} holds no stripes"
