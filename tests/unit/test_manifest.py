"""The run manifest: `collab init`'s folder, signatures, and what a peer may and may not set itself."""

from __future__ import annotations

import json

import pytest

from collab.config import load_config, user_settings
from collab.errors import UserError
from collab.run.folder import MANIFEST, load_run_folder
from collab.run.manifest import SignedManifest, config_for_peer, contradictions, sign, verify
from tests.conftest import write_config


@pytest.fixture()
def run_folder(tmp_path, micro_config):
    from collab.run.folder import create_run_folder

    folder = tmp_path / "demo"
    create_run_folder("demo-run", micro_config, load_config(micro_config), folder, private=False)
    return folder


def test_a_tampered_manifest_another_key_or_another_run_is_refused(run_folder):
    folder = run_folder
    blob = (folder / MANIFEST).read_bytes()
    key = load_run_folder(folder).fingerprint
    assert verify(blob, "demo-run", key).run_id == "demo-run"
    signed = SignedManifest.model_validate_json(blob)
    tampered = json.loads(signed.manifest)
    tampered["config"]["training"]["learning_rate"] = 1.0
    forged = SignedManifest(manifest=json.dumps(tampered, sort_keys=True, separators=(",", ":")),
                            signature=signed.signature).to_bytes()
    with pytest.raises(UserError, match="bad signature"):
        verify(forged, "demo-run", key)
    with pytest.raises(UserError, match=f"signed by key {key}, not --run-key 0123"):
        verify(blob, "demo-run", "0123" + key[4:])
    with pytest.raises(UserError, match="the manifest is for run 'demo-run', not --run-id 'other'"):
        verify(blob, "other", key)
    with pytest.raises(UserError, match="malformed"):
        verify(b"{not json", "demo-run", key)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match="not the tokenizer the manifest was signed with"):
        load_run_folder(folder)


def test_a_peer_sets_only_its_own_things(run_folder, tmp_path):
    folder = run_folder
    manifest = load_run_folder(folder).manifest
    mine = {"training": {"micro_batch_size": 4, "device": "cpu", "precision": "bf16"},
            "task": {"data": {"dataset": "/my/texts"}}, "checkpoint": {"dir": "/my/ckpt"}}
    assert contradictions(manifest, mine, None) == []
    assert contradictions(manifest, {"training": {"learning_rate": 0.5}}, None) == [
        "--learning-rate 0.5 differs from the run's manifest (training.learning_rate = 0.01)"]
    config = config_for_peer(manifest, mine, folder / "tokenizer.json")
    assert config.training.micro_batch_size == 4 and config.task.data.dataset == "/my/texts"
    assert (config.training.device, config.training.precision) == ("cpu", "bf16")  # a volunteer's hardware
    assert str(config.checkpoint.dir) == "/my/ckpt" and config.task.data.tokenizer == str(folder / "tokenizer.json")
    assert config.training.target_batch_size == 1024  # the run's
    other = write_config(tmp_path, {"training.target_batch_size": 4096, "training.learning_rate": 0.5})
    found = contradictions(manifest, user_settings(other, {}), f"--config {other}")
    assert sorted(found) == [f"training.learning_rate is 0.5 in --config {other} or --learning-rate, but the run's "
                             "manifest says 0.01",
                             f"training.target_batch_size is 4096 in --config {other} or --target-batch-size, "
                             "but the run's manifest says 1024"]


def test_the_first_peers_own_manifest_is_signed_like_an_organizers(micro_config):
    from collab.run.folder import ephemeral_run

    run = ephemeral_run("quick", load_config(micro_config))
    assert verify(run.signed, "quick", run.fingerprint).fingerprint == run.fingerprint
    assert sign(run.manifest, run.organizer_key).manifest == run.manifest.canonical().decode()


def test_the_manifest_is_published_at_once_on_a_machine_just_booted(micro_config, monkeypatch):
    """time.monotonic() counts from boot: on a VM up for 5 s, "published 0.0 s ago" must not mean "just now"
    (an organizer on a fresh GPU machine kept its manifest to itself for its first 200 s of uptime)."""
    import time
    from types import SimpleNamespace

    from collab.run.folder import ephemeral_run
    from collab.run.sharer import RunSharer, SharedRun
    from collab.run.sharing import MANIFEST_SUFFIX

    stored = []
    dht = SimpleNamespace(store=lambda **record: stored.append(record))
    swarm = SimpleNamespace(dht=dht, public_key=b"key", peer=SimpleNamespace(run_id="quick", client_mode=True))
    run = ephemeral_run("quick", load_config(micro_config))
    monkeypatch.setattr(time, "monotonic", lambda: 5.0)
    sharer = RunSharer(swarm, SharedRun(run.signed, run.fingerprint, tokenizer_file=None))
    sharer.start()
    assert [(r["key"], r["value"]) for r in stored] == [("quick" + MANIFEST_SUFFIX, run.signed)]
    sharer.refresh()  # and not again until a third of its lifetime has passed
    assert len(stored) == 1
