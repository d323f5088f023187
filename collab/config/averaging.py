"""The averaging section: how peers average (sync, diloco, gossip), with what compression, timeouts and rule."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from collab.sections import Section


# averaging.compression's choices (collab.averaging.compression says what each sends)
COMPRESSIONS = ("none", "fp16", "scaled-fp16", "uniform8bit", "quantile8bit", "size-adaptive", "powersgd", "dgc")


class DiLoCoConfig(Section):
    """averaging.mode diloco (collab.modes.diloco): local steps, then the swarm averages where each replica went."""
    outer_lr: float = Field(0.7, gt=0, le=10, description="the outer Nesterov SGD's learning rate (OpenDiLoCo's)")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="the outer Nesterov SGD's momentum")
    inner_lr: Optional[float] = Field(None, gt=0, description="the inner AdamW's learning rate (default: "
                                      "training.learning_rate)")
    inner_warmup_steps: int = Field(0, ge=0, le=10**7, description="linear warm-up of the inner learning rate, in "
                                    "this peer's own micro-batches")


GOSSIP_RULES = ("constant", "clock", "loss", "evolutionary")


class GossipConfig(Section):
    """averaging.mode gossip (collab.modes.gossip): no global step; pairwise merges with random peers."""
    mean_local_steps: float = Field(10.0, ge=1, le=10**6, description="local steps between a peer's merges: "
                                    "drawn from a Poisson distribution with this mean (at least 1)")
    interpolation: Literal[GOSSIP_RULES] = Field(
        "evolutionary", description="how far a merge moves toward the peer: constant (the value below); clock "
        "(peer's samples / both's); loss (the lower-loss model weighs more); evolutionary (a random split of the "
        "unit interval, the better model taking the smaller part)")
    constant: float = Field(0.5, ge=0, le=1, description="interpolation constant's factor")
    divergence_threshold: float = Field(0.0, ge=0, le=1e6, description="below this loss, a merge's factor shrinks "
                                        "by loss / threshold (0: off; dpwa's)")
    lr: Optional[float] = Field(None, gt=0, description="the local AdamW's learning rate (default: "
                                "training.learning_rate)")
    warmup_steps: int = Field(0, ge=0, le=10**7, description="linear warm-up of the local learning rate, in this "
                              "peer's own micro-batches")
    max_distance: float = Field(1.0, gt=0, le=100, description="a peer's parameters further than this (relative to "
                                "this replica's norm) are refused: a sign flip is 2, a replica 10x scaled 9")
    exchange_timeout: float = Field(30.0, gt=0, le=3600, description="seconds for one exchange of parameters; a "
                                    "peer that times out is picked less often")
    settle_seconds: float = Field(20.0, ge=0, le=3600, description="at --max-epochs, a peer stops training and keeps "
                                  "merging with the peers still there for up to this long before it saves and "
                                  "leaves, so that the replicas end close (0: leave at once)")
    settle_distance: float = Field(0.002, gt=0, le=1, description="settling ends early after two merges in a row "
                                   "that found the other replica this close (relative to this one's norm)")


class AveragingConfig(Section):
    mode: Literal["sync", "diloco", "gossip"] = Field(
        "sync", description="sync: the swarm averages gradients once per target batch (DeDLOC); diloco: each peer "
        "takes its own inner steps and the swarm averages where they went once per target batch (samples per "
        "outer step), then every replica takes the same outer step (collab.modes.diloco); gossip: each peer trains on "
        "its own and merges its parameters with a random peer's every few steps (collab.modes.gossip)")
    diloco: DiLoCoConfig = Field(default_factory=DiLoCoConfig)
    gossip: GossipConfig = Field(default_factory=GossipConfig)
    matchmaking_time: float = Field(5.0, gt=0, description="seconds spent forming an averaging group")
    group_size: Optional[int] = Field(
        None, ge=2, le=1024, description="begin a round as soon as this many peers joined its group instead of "
        "waiting out matchmaking_time (hivemind's target_group_size; for a swarm of known size)")
    averaging_timeout: float = Field(60.0, gt=0, description="give up an averaging round after this many seconds")
    load_state_timeout: float = Field(120.0, gt=0, description="seconds to download state from a peer")
    next_chunk_timeout: float = Field(
        10.0, gt=0, description="exclude a peer from a round if its next chunk takes longer (busy CPUs, slow links)")
    compression: Literal[COMPRESSIONS] = Field(
        "fp16", description="how gradients travel; see collab.averaging.compression for each choice's bytes and error")
    powersgd_rank: int = Field(4, ge=1, le=256, description="rank of PowerSGD's factors (compression: powersgd)")
    dgc_sparsity: float = Field(0.999, ge=0, lt=1, description="share of each matrix's values dgc leaves out")
    dgc_warmup_epochs: int = Field(4, ge=0, le=10**6, description="collaborative steps over which dgc's sparsity "
                                   "rises exponentially to dgc_sparsity (0: from the first)")
    dgc_momentum: float = Field(0.9, ge=0, lt=1, description="dgc's momentum (the optimizer's is off for the "
                                "matrices dgc sends)")
    overlap: Literal["none", "optimizer", "full"] = Field(
        "none", description="what runs in the background while the next micro-batches compute: nothing (state "
        "rounds always do); the optimizer step; or the gradient all-reduce too (one step of staleness). The "
        "optimizer step alone takes milliseconds (LAMB on ALBERT-tiny 6 ms, ALBERT-base 38 ms on one CPU core) and "
        "the micro-batch computed meanwhile is one step stale, so 'optimizer' is rarely worth it. diloco ignores "
        "it: its outer step replaces the parameters the inner steps work on, so nothing overlaps")
    average_state_every: int = Field(5, gt=0, description="also average parameters every N epochs (repairs drift)")
    bandwidth: Optional[float] = Field(None, gt=0, le=1e6, description="announced upload bandwidth, Mbit/s")
    aggregation: Literal["auto", "mean", "centered_clip", "adasum"] = Field(
        "auto", description="how each part of a round is combined: mean, or centered_clip (bounds what a few bad "
        "peers can do), or adasum (adds what is new in each peer's gradient: sync mode, lossless or 8-bit "
        "codecs; state rounds then use centered_clip); auto: centered_clip in an open run, mean in a private "
        "one (the manifest records which)")
    clip_tau: float = Field(2.0, gt=0, le=100, description="centered_clip's radius, in median distances of the "
                            "parts from their median (honest parts lie within it)")
    clip_iterations: int = Field(5, ge=1, le=100)
    max_weight_ratio: float = Field(10.0, ge=1, le=1e6, description="a peer's averaging weight (its samples) is "
                                    "capped at this many times its group's median")

    @model_validator(mode="after")
    def _diloco_fits(self):
        if self.aggregation == "adasum" and (self.mode != "sync" or self.compression in ("dgc", "powersgd")):
            raise ValueError("averaging.aggregation adasum combines whole gradients of sync mode; it cannot combine "
                             f"{'PowerSGD factors or DGC selections' if self.mode == 'sync' else self.mode + ' rounds'}"
                             ": use mean or centered_clip there")
        if self.mode == "sync":
            return self
        what = "diloco's pseudo-gradients" if self.mode == "diloco" else "gossip's parameters"
        if self.compression in ("dgc", "powersgd"):
            raise ValueError(f"averaging.compression {self.compression} keeps per-round state for gradients and "
                             f"cannot carry {what}; use fp16, uniform8bit or none")
        return self


def round_timeout_caution(averaging: AveragingConfig) -> Optional[str]:
    """A warning for timeouts under which a peer that dies as a round starts makes the round fail on every peer:
    hivemind leaves a silent sender out after next_chunk_timeout (a silent reducer after twice that), and a round
    still waiting at averaging_timeout is given up whole. Allowed (a swarm that never loses peers mid-round), but
    said: a swarm with both at 30 s can lose a whole round to a peer that dies as it starts."""
    if averaging.averaging_timeout > 2 * averaging.next_chunk_timeout:
        return None
    return (f"averaging.averaging_timeout ({averaging.averaging_timeout:g} s) is not over twice "
            f"averaging.next_chunk_timeout ({averaging.next_chunk_timeout:g} s): a round that a peer falls silent "
            "in can be given up on every peer before that peer is left out (after next_chunk_timeout as a sender, "
            "twice that as a reducer); raise averaging_timeout or lower next_chunk_timeout")


def join_request_timeout(matchmaking_time: float) -> float:
    """How long a peer asking another to lead its group waits for the answer. hivemind wants it under
    matchmaking_time (it breaks a rare deadlock of peers asking each other). Not much under: an asker that gives
    up asks again, with the same result, until its round ends, so a leader slower to answer than this (a peer
    whose CPU is busy training) is never joined and both lose the round (tests/swarm/test_matchmaking.py). Likely
    on a CPU-starved machine: a server and its client-mode peer (which can join no one else) fail a round, the
    client's "could not find a group", under a tighter timeout such as min(3, matchmaking_time / 2)."""
    return 0.8 * matchmaking_time
