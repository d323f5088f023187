"""hivemind's identity check starts an anonymous p2pd with P2P.create's default startup_timeout (15 s), whatever the
peer gave its own: 3 of 64 peers started together on 2 cores failed so ("Daemon failed to start in 15.0 seconds")."""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

from collab.hivemind_hooks import patches


def test_a_p2pd_start_that_names_no_timeout_gets_the_peers_own_the_identity_checks_included(monkeypatch, tmp_path):
    given = []

    async def recorded(cls, *args, **kwargs):
        given.append(kwargs.get("startup_timeout"))
        raise RuntimeError("not started here")

    monkeypatch.setattr(P2P, "create", classmethod(recorded))
    monkeypatch.setattr(P2P, "_collab_startup_timeout", None, raising=False)
    patches.p2pd_starts_given(60.0)
    patches.p2pd_starts_given(42.0)  # once wrapped; the latest peer's value holds

    identity = tmp_path / "peer.identity"
    P2P.generate_identity(str(identity))
    for start in (lambda: P2P.create(), lambda: P2P.create(startup_timeout=5.0),
                  lambda: P2P.is_identity_taken(str(identity), initial_peers=[], tls=True, use_auto_relay=False,
                                                use_ipfs=False, use_relay=True)):
        try:
            asyncio.run(start())
        except RuntimeError:
            pass
    assert given == [42.0, 5.0, 42.0]
