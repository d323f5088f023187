"""A planned leader woken by its followers' asks (collab.averaging.woken_leader): what it notes, and when it begins."""

from types import SimpleNamespace

from hivemind.utils import get_dht_time

from collab.averaging.round_plans import PlansRounds, epoch_prefix
from collab.averaging.woken_leader import WokenByAsks, epoch_of_key
from collab.modes.sync import CollabOptimizer

BASE = "run_grad_averager"


def test_only_a_gradient_rounds_key_of_this_run_names_an_epoch():
    assert epoch_of_key(f"{epoch_prefix(BASE, 7)}.0b", BASE) == 7  # the key a round is matched under parses back
    assert epoch_of_key(f"{BASE}_epoch7.0b", BASE) == 7
    assert epoch_of_key(f"{BASE}_epoch12.0b0110", BASE) == 12
    for key in ("other_grad_averager_epoch7.0b", f"{BASE}.0b", f"{BASE}_epoch7", f"{BASE}_epoch{10 ** 12}.0b",
                f"{BASE}_epoch-1.0b", f"{BASE}_epoch7.0b2", None, b"bytes"):
        assert epoch_of_key(key, BASE) is None, key


class _Rounds(PlansRounds, WokenByAsks):  # as in CheckedRounds
    pass


def _averager(looking: bool) -> WokenByAsks:
    averager = _Rounds()
    averager._matchmaking = SimpleNamespace(is_looking_for_group=looking,
                                            group_key_manager=SimpleNamespace(prefix=f"{BASE}_epoch3"))
    averager._base_group_prefix = BASE  # set by the first round (round_plans._match_within_epoch)
    averager.listen_for_asks()
    return averager


def test_an_ask_is_noted_only_while_this_peer_is_not_searching_and_the_newest_epoch_wins():
    averager = _averager(looking=False)
    assert averager.asked_to_lead() is None
    averager._note_ask(f"{BASE}_epoch5.0b")
    averager._note_ask(f"{BASE}_epoch4.0b")  # a late ask of an older round leaves the newest
    averager._note_ask("forged_epoch99.0b")
    assert averager.asked_to_lead() == 5
    searching = _averager(looking=True)  # then the ask is an ordinary join request
    searching._note_ask(f"{BASE}_epoch5.0b")
    assert searching.asked_to_lead() is None


def test_an_ask_for_a_round_yet_to_be_searched_for_is_answered_coming_and_a_far_one_is_not():
    """The asker is told to ask on (NOT_DECLARED) only for a round this peer will search for: not one it searched for
    already (its round is over), not a far epoch (forged: noted, it would stop every later wake)."""
    averager = _averager(looking=False)
    assert averager._note_ask(f"{BASE}_epoch5.0b")  # no round searched for yet: any epoch may be its first
    averager._searched_epoch = 5  # (round_plans._match_within_epoch, as its search for epoch 5 began)
    assert not averager._note_ask(f"{BASE}_epoch5.0b")  # that search is over
    assert averager._note_ask(f"{BASE}_epoch6.0b") and averager._note_ask(f"{BASE}_epoch7.0b")
    assert not averager._note_ask(f"{BASE}_epoch8.0b")  # further than a missed round
    assert averager.asked_to_lead() == 7
    assert not _averager(looking=True)._note_ask(f"{BASE}_epoch5.0b")  # searching: hivemind answers


def _optimizer(asked, local_epoch: int, control=None):
    return SimpleNamespace(grad_averager=SimpleNamespace(asked_to_lead=lambda: asked), local_epoch=local_epoch,
                           scheduled_grads=control)


def test_the_trainer_begins_its_round_when_asked_for_its_own_epoch_and_no_round_is_under_way():
    assert CollabOptimizer._asked_to_lead_now(_optimizer(5, 5))
    done = SimpleNamespace(triggered=True, done=lambda: True)
    assert CollabOptimizer._asked_to_lead_now(_optimizer(5, 5, done))
    searching = SimpleNamespace(triggered=False, done=lambda: False)
    assert not CollabOptimizer._asked_to_lead_now(_optimizer(5, 5, searching))  # its round already began
    assert not CollabOptimizer._asked_to_lead_now(_optimizer(4, 5))  # an older epoch's ask
    assert not CollabOptimizer._asked_to_lead_now(_optimizer(6, 5))  # a forged or future one: never early twice
    assert not CollabOptimizer._asked_to_lead_now(_optimizer(None, 5))


class _Averager:
    def __init__(self, asked):
        self.asked, self.steps = asked, []

    def asked_to_lead(self):
        return self.asked

    def schedule_step(self, **kwargs):
        self.steps.append(kwargs)
        return SimpleNamespace(triggered=False, done=lambda: False)


def _trainer(asked, local_epoch: int = 5):
    """A CollabOptimizer (its constructor skipped) whose own reads say the epoch ends in 100 s: hivemind's forecast
    alone schedules nothing."""
    trainer = object.__new__(CollabOptimizer)
    trainer.__dict__.update(
        grad_averager=_Averager(asked), state_averager=SimpleNamespace(local_epoch=local_epoch), scheduled_grads=None,
        averaging_timeout=30.0, _parent_pid=-1,  # (not this process's: hivemind's __del__ shuts nothing down)
        matchmaking_time=3.0, use_gradient_averaging=True, status_loglevel=10,
        tracker=SimpleNamespace(global_progress=SimpleNamespace(num_peers=3),
                                estimated_next_update_time=get_dht_time() + 100))
    return trainer


def test_asked_for_its_own_epoch_the_trainer_schedules_its_round_now_whatever_its_forecast():
    woken = _trainer(asked=5)
    woken.schedule_gradient_round()
    assert woken.grad_averager.steps == [dict(timeout=30.0)] and woken.scheduled_grads is not None
    assert woken.grad_averager.epoch == 5  # the round carries its epoch: matched under that epoch's key
    woken.schedule_gradient_round()  # its round is under way: not a second one
    assert len(woken.grad_averager.steps) == 1
    for asked in (None, 4, 6):
        waiting = _trainer(asked)
        waiting.schedule_gradient_round()
        assert waiting.grad_averager.steps == [] and waiting.scheduled_grads is None, asked
