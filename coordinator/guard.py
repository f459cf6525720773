"""Bounds on what one update can do, applied to a round's updates before any aggregation rule sees them.

A device with valid credentials can send any finite weights and claim any sample count. These hold whatever the
rule (`[guard]` in the coordinator file; what the defaults withstand is measured in docs/security.md):

- **Sample counts**: a claim beyond `max_samples` (a fleet maximum; 0: none) or `sample_factor` times the round's
  median count (0: none), or beyond the (f+1)-th largest claim of the round, f = `sample_rank` x n rounded down (0,
  the default: none; a cap that skewed honest claims, which differ by far more than 10x at Dirichlet 0.1, pass but
  for the f largest), is refused (`sample_bound = "reject"`, the default: no honest device holds more samples
  than its store, and honest counts differed at most 3.3x from the median in the fleets of Dirichlet 1; at 0.1
  some honest claims lie beyond 10x, and are refused: docs/results.md, issue 56), or counted as the
  cap (`"cap"`), so one claim of 10^9 samples cannot replace the global model under FedAvg.
- **Update norms**: each update's distance from the global model, ||w_k - g||, is compared with `norm_factor`
  times the round's median distance. Beyond it, `norm_bound = "reject"` (the default) drops the update, `"clip"`
  scales its change back onto that bound (w_k -> g + s (w_k - g)), `"off"` lets it through. A clipped update still
  moves the model `norm_factor` typical updates' worth, in any direction it likes (a scaled honest update clipped
  so cost 59 points, rejected nothing); the distances of honest updates reached 2.65x their median. Bounding
  relative to the median follows the adaptive clipping of robust FL (e.g. Sun et al. 2019, "Can you really
  backdoor federated learning?"); the factor is ours.
- **Free riders**: an update that claims samples but moved the model less than `free_rider_factor` times the
  median distance (the global model sent back) is refused; honest updates moved at least 0.45x the median at
  Dirichlet 1. At 0.1 the guard refused 13 % of honest updates so: each the global model exactly, from a device
  whose store held one class (under its mask, a loss of 0); such a device now claims no samples
  (edge_client/device.py `_claims`) and is no free rider. Keeping a short step that lowered the calibration loss of
  what it trained on at all (the reference's) kept 1 honest update in about 1,500 and let `tinynoise` in more
  often (-1.7 to -3.4 points): not done (docs/results.md, issue 56).
- **Krum selection** (Blanchard et al. 2017, Multi-Krum; Flower's MultiKrum), in rounds without a calibration
  reference (below; `krum_when = "always"`: in every round): of the n updates left, the f = `krum_share` x n (rounded
  down; a quarter) whose Krum scores are worst are named, and refused (`krum-outlier`) unless taken back (below). An
  update's score is the sum of its squared distances to its n - f - 2 nearest others (at least one): an update unlike
  its neighbours scores badly however long it is or however it points, which is what a reversed update within every
  bound above looks like. FedAvg over the rest is Multi-Krum. A round of 3 or fewer updates loses none (f = 0); from 4
  on, Krum names f of them every round, honest ones in a clean round, and unevenly (one honest device in 13 of 15
  rounds): without what follows, the clean 6-device runs moved by -1.4 +- 7.8 points against FedAvg's over 10 seeds.
  So a named update is taken back when it lies within `krum_radius` (2) times the farthest kept update's distance from
  the kept updates' mean: an honest update on other classes is farther from its neighbours than they are from each
  other, but seldom twice as far from their centre as the farthest of them; a reversed one mostly is. With the radius,
  Krum refused 0-2 honest updates of 90 in a clean 6-device run, and those runs moved by +0.5 +- 1.8 points against
  FedAvg's over 10 seeds (docs/security.md). A radius of 1 or less takes back little (the named update is mostly the
  farthest from the centre); 0 none. What the radius lets in is what lies near the honest updates' centre: a drifting
  update, and a reversed one in rounds where honest updates disagree. The scores are exact among a round's first
  `hold` updates; each later one is scored against those kept, and refused when worse than the worst of them and
  beyond the radius (`KrumSelection`, coordinator/krum.py): a round's cost stays `hold` distances an update, not N.
  Two updates are compared on what neither's classes own (`krum_compare = "classes"`, the default; "whole": as they
  are): the head rows of the classes either claims (its `trained_counts`) are left out of their distance, and of an
  update's distance from the kept ones' centre those of the classes it or any kept one claims. A class's row is what
  its holders' data make of it: a device alone with a class differs from the others by that row, and so does one that
  holds one of a session's two classes. In SDD's few-shot sessions (2 new classes over 4 devices, a few samples each)
  Krum refused 14 % of the honest updates with whole updates compared, and 1 of 36 with the rows of the classes both
  held still compared (issue 56). The body is still compared, which is where an update that undoes what the round
  learns differs; what a device does to its own classes' rows, no comparison with peers sees (the row bound below
  limits their length). There the body, trained at a thousandth of the head's rate, is nearly all that is compared,
  and honest bodies differ by about a hundredth of an update's length: a device whose one sample pointed its body
  elsewhere lay just beyond the radius. So a named update is also taken back within `krum_floor` (0.05) times the
  round's median distance from the global model of the centre: a twentieth of a typical update is no harm worth a
  refusal. An update that learnt nothing (the global model, claiming no samples) is neither scored nor a reference
  (`KrumSelection`: in a 2000-device fleet such first arrivals had every learner after them refused).
- **Direction** (`min_alignment`, -0.9 by default; -1: off): an update whose change points against the round's
  others (its cosine with the sum of the others' changes below `min_alignment`) is refused (`direction_bound =
  "reject"`), or turned (`"project"`): its component along the others' direction is raised until its cosine is
  `min_alignment` (at 0: what pointed against them is taken out), and what is orthogonal to them, which is where an
  update on classes the others do not hold lies, stays (`turned`). Honest updates on
  non-IID data reached -0.34 in a first round (from a random model), so a threshold that catches reversed updates
  refuses honest ones too; measured weaker than Krum selection against a reversed update. At -0.9 it refused no
  honest update in the attack suite's runs and holds the updates that point straight back (issue 56).
- **The fleet's last step undone** (`min_progress`, -0.95 by default; -1: off): an update whose change points back
  along the fleet's last global step (its cosine with g - g', g' the global model before this one, below
  `min_progress`) is refused (`undoes-last-step`). Sending g' back, or any part of the way to it, is an update that
  keeps the device's own data as the fleet had it a round ago and pulls every class the round learnt back
  (`reversed-step` in firmware_sim/adversary.py; the calibration reference passed 35 of its 45 updates), and points -1
  against the step. Honest updates learn what the step learnt or something new, which is orthogonal to it: on digits
  they pointed at least -0.53 against it in 1,500 updates, but in one round at Dirichlet 0.1 three of six pointed
  -0.81 to -0.83 (the round after a step they all corrected), so a bound must sit below that: -0.95 is measured (issue
  56, docs/results.md). The coordinator knows g' once a round has made a new global model since it started (not in a
  resumed run's first round): until then nothing is checked.
- **Calibration reference** (`reference = "classes"`, the default; "off"): an update that raises the calibration loss
  of what it trained on (its `trained_counts`, by task and class, on samples the coordinator keeps apart from every
  device and test set) by more than `reference_tolerance` nats above the global model's is refused
  (`worse-on-own-classes`; coordinator/reference.py). It compares a device with the model, not with the other devices,
  so an update on classes no other device holds passes it. A claim of a class none of the run's tasks so far brings
  cannot be compared and no honest device makes one: refused (`unreached-classes`), and so is a claim of samples of
  the round's task of a class the task does not bring (`misplaced-classes`). Without calibration samples it is off
  (the coordinator says so once). With `trust_margin` (nats; 0.05 by default, 0: off) an update that lowers that loss
  by less than the margin counts that share of its samples, none where it does not lower it (`weighed-down`): a bound
  on influence, not a refusal. Only in rounds whose typical update lowers its mix's loss by the margin, and on the
  parts of its mix it lowered (`trust_on = "gained"`; "net": the whole mix), so that the old classes a replaying
  device overfits a little do not weigh its update down (`trusted`).
- **Vouched for** (`reference_vouches`, on by default): with a calibration reference, an update that a size bound
  above would refuse (its claim, its distance, a free rider's short step) is kept at the bound where the reference
  vouches for it: it lowers the calibration loss of what it trained on by what the trust weight asks of its claim,
  beyond what each of 19 random steps as long does (noise far beyond the bound lowers the loss of a new task's classes
  too, where the global model is confidently wrong) (`vouched`). Its claim is then capped at the cap and its change
  clipped onto the distance bound: no more than an update within the bounds may do. The size bounds compare a device
  with the round's median, and in fleets of 3 or 4 at Dirichlet 0.1 or under client dynamics 1-2 % of honest updates
  fell outside them (issue 56); the global model sent back and an update scaled past what it learnt do not lower
  that loss, and noise lowers it no more than noise does.
- **Copies** (`copy_factor`, 0.01 by default; 0: off): updates within `copy_factor` times the shorter of their
  changes of each other are one update sent k times, and each counts 1/k of its samples (`copies`; a bound on
  influence, nothing refused): devices that send an honest device's update as theirs (`mimic`) make its data count k
  times, and pass every other bound. Among a round's held updates; a later one that copies a held one counts none.

The medians are taken over the updates that carry something: counts above 0, distances above 0. A device with
nothing to train on this round (an empty share, a task that brought it no data) sends the global model back with
0 samples; were those the majority, a median of 0 would cap every honest count at 0 and clip every honest update
back onto the global model (seen: 1000 devices sharing 270 samples learnt nothing). With no such update there is
no bound to take, and none applies; such a device is no free rider either (it claims nothing).

A rule that folds updates as they arrive (FedAvg, FedProx) cannot wait for the round's medians without holding the
round, which is what folding avoids. For it the bounds stream (`BoundedStream`): the round's first `hold` updates
(`[guard] hold`) wait and are bounded together, exactly as a round of that many (an update that learnt nothing, the
global model claiming no samples, waits with them uncounted: `KrumSelection`); every later update is bounded as
it arrives by the medians over all updates so far, itself included, and goes on: its Krum score is taken against
the held updates that were kept (refused when worse than the worst of theirs; they stay for the round, `hold`
models at most) and its direction against the changes taken so far. A round of at most `hold` updates is bounded
exactly as a held one, and a larger one holds `hold` updates at most. The bound stays a median's: each update is
bounded by the majority of those before it, so hostile updates move it only where they are the majority of a
round's first arrivals; `hold` sets how many arrivals that takes.

Last, what every bound above passed is bounded in its influence, not refused (coordinator/influence.py, on by
default): how far an update steps back toward the first global model (`way_back`) and how long it makes a class's
head row (`row_factor`), each against the median of the round's.

Every bound that acts is counted (`samples-rejected`, `samples-capped`, `norm-rejected`, `clipped`, `free-rider`,
`krum-outlier`, `misaligned`, `turned`, `undoes-last-step`, `unreached-classes`, `misplaced-classes`,
`worse-on-own-classes`; `vouched`, `weighed-down`, `copies`, `pulled-back` and `row-clipped` for the bounds on
influence) in the run's counters and logged (`weighed-down`, `pulled-back` and `row-clipped`, which change a share
of a round's honest updates by design, at debug level; `vouched` at info; `copies`, which no honest device sends, as
a warning). The robust rules
(coordinator/strategies/robust.py) go further; the bounds compose with them and with every other rule.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from coordinator.compute import UpdateChanges, distance, within_length
from coordinator.guard_settings import GuardSettings
from coordinator.influence import UNKNOWN_PATH, FleetPath, HeadLayout, RoundInfluence
from coordinator.krum import KrumSelection, learnt_nothing
from coordinator.medians import RunningMedian, RunningTypical, typical
from coordinator.reference import ClassReference, LossChange
from coordinator.strategies.base import ClientUpdate
from coordinator.strategies.robust import DistancesTo
from edgefil.logs import names_line

log = logging.getLogger("edgefil.coordinator")


class UpdateBounds(GuardSettings):
    """The bounds above, as `[guard]`'s settings (`GuardSettings`) set them, applied to a round's updates."""

    @classmethod
    def of(cls, settings: GuardSettings) -> UpdateBounds:
        """The bounds that `settings` (a coordinator file's `[guard]`) set."""
        return settings if isinstance(settings, cls) else cls(**dataclasses.asdict(settings))

    def selection(self, reference: ClassReference | None, heads: HeadLayout | None = None,
                  global_weights: np.ndarray | None = None) -> KrumSelection:
        """The round's Krum selection: none (a share of 0) in a round that has a calibration reference, unless
        `krum_when = "always"`. Krum compares updates with each other, so it reads a device that brings classes no
        other holds as an outlier (issue 56: the same honest device refused in 10 of 10 rounds); the reference
        compares each update with the model on what it trained on, and with it the attacks Krum is there for are
        bounded without it (docs/security.md). A round without a reference has only the comparison with the others."""
        compared = reference is not None and self.reference != "off" and self.krum_when != "always"
        return KrumSelection(0.0 if compared else self.krum_share, self.hold, self.krum_radius,
                             heads if self.krum_compare == "classes" else None, self.krum_floor, global_weights)

    def influence(self, widened: UpdateChanges, path: FleetPath, heads: HeadLayout | None
                  ) -> RoundInfluence | None:
        """The round's influence bounds (coordinator/influence.py), None where none is on or can act. `widened`: the
        round's changes from its global model (`UpdateChanges`)."""
        way_back = path.way_back if self.checks_way_back else None
        if way_back is None and (heads is None or not self.row_factor):
            return None
        return RoundInfluence(widened, way_back, self.way_back_slack, heads, self.row_factor)

    def sample_cap(self, counts: RunningTypical) -> float:
        """The most samples an update may count for, given the round's claims so far: max_samples (0: none),
        sample_factor x their typical count (0: none), and the (f+1)-th largest of them, f = sample_rank x n
        rounded down (0: none): so f devices that claim more than every honest one count as the largest honest
        claim, and a round of skewed honest claims loses only its f largest's excess."""
        cap = float(self.max_samples) if self.max_samples else math.inf
        typical_count = counts.value()
        if self.sample_factor and typical_count is not None:
            cap = min(cap, self.sample_factor * typical_count)
        ranked = counts.below_top(self.sample_rank) if self.sample_rank else None
        if ranked is not None:
            cap = min(cap, ranked)
        return cap

    def distance_bounds(self, typical_distance: float | None) -> tuple[float, float]:
        """How little and how far an update may move the model: free_rider_factor and norm_factor x the typical
        distance (none when off or unknown)."""
        if typical_distance is None:
            return 0.0, math.inf
        upper = self.norm_factor * typical_distance if self.norm_bound != "off" else math.inf
        return self.free_rider_factor * typical_distance, upper

    def apply(self, global_weights: np.ndarray, updates: Sequence[ClientUpdate], counters: Counter[str],
              measured: Sequence[float] | None = None, selection: KrumSelection | None = None,
              reference: ClassReference | None = None, path: FleetPath = UNKNOWN_PATH,
              heads: HeadLayout | None = None, influence: RoundInfluence | None = None,
              changes: RunningMedian | None = None, widened: UpdateChanges | None = None,
              taken_rows: DistancesTo | None = None) -> list[ClientUpdate]:
        """A whole round's updates within the bounds (clipped ones are new arrays; the others are passed as they
        are). `measured`: their distances from the global model, when known already; `selection`: the round's Krum
        selection, which keeps what it learns for later updates (a stream's); `reference`: the round's calibration
        reference (None: no check); `path`: where the fleet's model has been (`FleetPath`) and `heads` the model's
        head layout, for the influence bounds, applied last; `influence`: a stream's (which learns from each batch),
        else the round's own; `changes`: a stream's calibration loss changes so far (`add_change`), which these
        join; `widened`: a stream's changes from the global model (`UpdateChanges`), else the round's own;
        `taken_rows`: a stream's rows of these updates for the copy check of its later ones, which Krum's selection
        reads too (`KrumSelection.select`)."""
        widened = UpdateChanges(global_weights) if widened is None else widened
        if measured is None:
            measured = [widened.length(u.weights) if self.measures_distance else 0.0 for u in updates]
        counts = RunningTypical([u.num_samples for u in updates])
        cap = self.sample_cap(counts)
        typical_distance = typical(measured)
        lower, upper = self.distance_bounds(typical_distance)
        within = (self.bounded(global_weights, u, d, cap, lower, upper, counters, reference, counts.value())
                  for u, d in zip(updates, measured))
        progressing = [p for p in (self.progressing(widened, u, path.last_step, counters)
                                   for u in within if u is not None) if p is not None]
        changes = changes if changes is not None else RunningMedian()
        compared = [self.compared(u, reference) for u in progressing]
        for change in compared:
            self.add_change(changes, change)
        checked = [c for c in (self.referenced(u, reference, counters, counts.value(), changes.value(), change)
                               for u, change in zip(progressing, compared)) if c is not None]
        checked = self.counted_once(widened, checked, counters)
        kept = (selection or self.selection(reference, heads, global_weights)).select(checked, counters,
                                                                                      typical_distance, taken_rows)
        if self.checks_direction and len(kept) >= 2:
            total = change_sum(widened, kept)
            directed = (self.directed(widened, u, total, counters, True, typical_distance) for u in kept)
            kept = [u for u in directed if u is not None]
        # last: the bounds above that refuse judge what a device sent, not what these make of it
        influence = influence or self.influence(widened, path, heads)
        return kept if influence is None else influence.bound(kept, counters)

    def stream(self, global_weights: np.ndarray, take: Callable[[ClientUpdate], None], counters: Counter[str],
               reference: ClassReference | None = None, path: FleetPath = UNKNOWN_PATH,
               heads: HeadLayout | None = None) -> BoundedStream:
        return BoundedStream(self, global_weights, take, counters, reference, path, heads)

    def progressing(self, widened: UpdateChanges, update: ClientUpdate, last_step: np.ndarray | None,
                    counters: Counter[str]) -> ClientUpdate | None:
        """The update, unless its change points back along the fleet's last global step (its cosine with
        `last_step` below `min_progress`: refused, `undoes-last-step`). A device that claims no samples counts for
        nothing and is not checked."""
        if last_step is None or not self.checks_progress or update.num_samples <= 0:
            return update
        cosine = alignment(widened, update.weights, last_step, False)
        if cosine is None or cosine >= self.min_progress:
            return update
        counters["undoes-last-step"] += 1
        log.warning("update of %s dropped: it points %+.2f (cosine) along the fleet's last step, under %+.2f: it "
                    "undoes it", update.device, cosine, self.min_progress)
        return None

    def compared(self, update: ClientUpdate, reference: ClassReference | None) -> LossChange | None:
        """How much the update raises its mix's calibration loss (`ClassReference.loss_change`), None where the
        reference does not compare it: none, off, an update that claims no samples, or one refused for its claim
        (`referenced`). The one place that says which updates the reference compares (`referenced`, `vouched`)."""
        if reference is None or self.reference == "off" or update.num_samples <= 0 or reference.unreached(update) \
                or reference.misplaced(update):
            return None
        return reference.loss_change(update)

    def add_change(self, changes: RunningMedian, change: LossChange | None) -> None:
        """One update's calibration loss change (net) into the round's (`changes`), whose median is the round's
        typical change (`trusted`): only the changes of updates the reference passes, so that updates it refuses do
        not move it."""
        if change is not None and change.net <= self.reference_tolerance:
            changes.add(change.net)

    def referenced(self, update: ClientUpdate, reference: ClassReference | None, counters: Counter[str],
                   typical_count: float | None = None, typical_change: float | None = None,
                   change: LossChange | None = None) -> ClientUpdate | None:
        """The update, unless it claims samples of a class the run has not reached (refused: `unreached-classes`) or
        samples of the round's task of a class the task does not bring (`misplaced-classes`), or makes its own classes
        worse on the coordinator's calibration samples by more than `reference_tolerance` (refused:
        `worse-on-own-classes`); with `trust_margin`, its samples are counted by how much it lowers that loss
        (`trusted`; `typical_count`: the round's typical claim, `typical_change`: its typical loss change; `change`:
        this update's, when `compared` took it already). A device that claims no samples is not compared: it counts
        for nothing."""
        if reference is None or self.reference == "off" or update.num_samples <= 0:
            return update
        unreached = reference.unreached(update)
        if unreached:
            counters["unreached-classes"] += 1
            log.warning("update of %s dropped: it claims samples of classes the run has not reached (%s; tasks 0..%d "
                        "bring %s)", update.device, names_line(map(str, unreached)), reference.ctx.task,
                        ", ".join(map(str, reference.ctx.seen_classes)))
            return None
        misplaced = reference.misplaced(update)
        if misplaced:
            counters["misplaced-classes"] += 1
            log.warning("update of %s dropped: it claims samples of task %d of classes %s, which the task does not "
                        "bring (%s)", update.device, reference.ctx.task, names_line(map(str, misplaced)),
                        ", ".join(map(str, reference.ctx.task_classes)))
            return None
        change = reference.loss_change(update) if change is None else change
        if change.net <= self.reference_tolerance:
            counted_on = change.gained if self.trust_on == "gained" else change.net
            return self.trusted(update, counted_on, counters, typical_count, typical_change)
        counters["worse-on-own-classes"] += 1
        parts, weights = reference.compared_on(update)
        log.warning("update of %s dropped: it raises the calibration loss of what it trained on (%s) by %.3g nats, "
                    "over %.3g", update.device, ", ".join(f"task {t} class {c}: {w:.0f}"
                                                          for (t, c), w in zip(parts, weights)),
                    change.net, self.reference_tolerance)
        return None

    def trusted(self, update: ClientUpdate, change: float, counters: Counter[str],
                typical_count: float | None = None, typical_change: float | None = None) -> ClientUpdate:
        """The update, its samples counted by how much it lowered its mix's calibration loss (`change`, nats: what
        `trust_on` reads of its `LossChange`, the parts of the mix it lowered by default): all of them where it
        lowered it by `trust_margin` x its claim in the round's typical claims (`typical_count`; at least 1), that
        share of them below, none where it did not lower it. FLTrust's trust score (Cao et al.,
        NDSS 2021) on the loss rather than a direction: what weighs in FedAvg is what a device shows it learnt, so
        an update that learnt nothing of its data (noise, the global model sent back with a little noise:
        `tinynoise`) weighs nothing, whatever it claims, without being refused, and an honest one that learnt
        little weighs little (issue 56: 90 % of honest updates on digits lowered their mix's loss, by a median of
        0.46 nats). The more it claims, the more it must show: under the margin alone, noise whose claim of 10^9
        samples was capped at 10x the typical count, and which lowered its loss a little, still cost 11.8 points
        at 1 of 4 (`samples`). A bound on influence: nothing is refused here.

        What it lowered, not its net change (`trust_on = "gained"`): an honest device whose store is mostly old
        classes overfits them a little in ten local epochs while it learns its new ones, so its whole mix's loss
        rose (by up to 0.25 nats on digits' fleet of 20, in rounds whose typical update lowered it) and, counted on
        that, it weighed nothing: the devices that replay what the fleet is forgetting. That cost the fleet of 20
        1.2 points of average accuracy against plain FedAvg over 10 seeds (t -3.3), and counted on what they gained
        0.3 (without the weight 0.4; issue 56, docs/results.md). What refuses an update stays its net change
        (`referenced`); noise gains on few parts, and little.

        Only in a round whose typical update (`typical_change`: the median change of the updates the reference
        passed; None: unknown) lowers its mix's loss by the margin: where it does not, learning little is what the
        round's updates do, and the weight would tell nothing apart. On Fashion-MNIST the honest updates of a task's
        later rounds raised their mix's loss by 0.1-0.7 nats (ten local epochs make a model that already knows its
        classes overconfident on samples it has not seen): every one of them counted none of its samples in 6 of 15
        rounds, and in the last round of one run the one update that lowered its loss was the round's whole model,
        which knew its own task and little else (79.8 -> 25.6 %, against 78.3 % for plain FedAvg; issue 56). Where
        the typical update lowers it by the margin, half the round's updates lower it at least as much: no single
        update is left to be the round."""
        if self.trust_margin <= 0 or (typical_change is not None and typical_change > -self.trust_margin):
            return update
        required = self.required(update, typical_count)
        if change <= -required:
            return update
        counted = int(update.num_samples * max(0.0, -change) / required)
        counters["weighed-down"] += 1
        log.debug("%s lowered its mix's calibration loss by %.3g nats, under %.3g: %d of its %d samples counted",
                  update.device, -change, required, counted, update.num_samples)
        return dataclasses.replace(update, num_samples=counted)

    def counted_once(self, widened: UpdateChanges, updates: list[ClientUpdate],
                     counters: Counter[str]) -> list[ClientUpdate]:
        """The updates, those that are copies of each other sharing one update's weight: two updates are copies
        where they lie within `copy_factor` times the shorter of their changes of each other (chained), and each of
        k copies counts 1/k of its samples (`copies`). Honest devices train on data of their own and never send the
        same model; devices that send one honest update as theirs (`mimic`, Karimireddy et al. 2022) make its data
        count k times, which took 3.0 ± 5.3 points at 2 of 8 (11-13 in two of 10 seeds) while passing every other
        bound: the copy is as good as the honest update it is (issue 56). Which of them is the original cannot be
        told, so none is refused and all share. Relative to the changes, not to the round's typical distance: two
        updates that both barely moved lie near each other without being one. Updates claiming no samples (the
        global model sent back by devices with nothing to train on) are alike by right and not counted. The first
        `hold` that claim samples are compared pairwise; each later one (a holding rule's whole round) with those, and
        counts none of its samples where it copies one: a round costs `hold` distances an update, not N, as Krum's
        does (a stream's held updates are the first `hold` that learnt something, and those that learnt nothing)."""
        if not self.copy_factor:
            return updates
        # the first `hold` that claim samples, compared pairwise; each later one with these (as a stream's: `copied`)
        claiming = [k for k, u in enumerate(updates) if u.num_samples > 0]
        claiming, later = claiming[: self.hold], claiming[self.hold:]
        moved = {k: widened.length(updates[k].weights) for k in claiming}
        group = {k: k for k in claiming}  # union-find over the pairs that are copies

        def root(k: int) -> int:
            while group[k] != k:
                k = group[k]
            return k

        for a, i in enumerate(claiming):
            for j in claiming[a + 1:]:
                if root(i) != root(j) and self.copies(updates[i], updates[j], moved[i], moved[j]):
                    group[root(j)] = root(i)
        sizes = Counter(root(k) for k in claiming)
        shared = list(updates)
        for k in claiming:
            copies = sizes[root(k)]
            if copies > 1:
                counters["copies"] += 1
                log.warning("update of %s counts 1/%d of its samples: it is a copy of %d other update(s) of the round",
                            updates[k].device, copies, copies - 1)
                shared[k] = dataclasses.replace(updates[k], num_samples=updates[k].num_samples // copies)
        taken = [(updates[k], moved[k]) for k in claiming]
        rows = self.taken_rows_of(widened.global_weights, taken) if later else None
        for k in later:
            shared[k] = self.copied(updates[k], widened.length(updates[k].weights), taken, counters, rows, widened)
        return shared

    def copies(self, a: ClientUpdate, b: ClientUpdate, moved_a: float, moved_b: float,
               apart: float | None = None) -> bool:
        """Whether `a` and `b` (their changes `moved_a`, `moved_b` long) lie within `copy_factor` times the shorter
        change of each other. Two changes' lengths differ by at most the distance between the updates (the triangle
        inequality), so a pair whose lengths differ by more than that bound is no copy, and is not measured: most
        pairs, so a round's copies cost a few distances, not `hold` an update (the margin covers float64's
        rounding of the lengths, about 1e-15 of them). `apart`: their distance, where the caller has it."""
        bound = self.copy_factor * min(moved_a, moved_b)
        if abs(moved_a - moved_b) > bound * (1 + COPY_MARGIN):
            return False
        return (distance(a.weights, b.weights) if apart is None else apart) <= bound

    def copied(self, update: ClientUpdate, moved: float, taken: Sequence[tuple[ClientUpdate, float]],
               counters: Counter[str], taken_rows: DistancesTo | None = None,
               widened: UpdateChanges | None = None) -> ClientUpdate:
        """A later update of a stream (`moved`: its change's length), counting none of its samples where it is a
        copy of one taken before it (`taken`: those and their changes' lengths), whose samples count already
        (`counted_once` for the held ones). `taken_rows`: `taken`'s cached rows (`taken_rows_of`), which measure
        the update against all of them at the cost of one distance; None: each pair measured alone. `widened`: the
        round's changes from their origin, the global model, where the caller has them (`UpdateChanges`)."""
        if not self.copy_factor or update.num_samples <= 0:
            return update
        apart = np.sqrt(taken_rows(update.weights, widened)) if taken_rows is not None else None
        if not any(u.num_samples > 0 and self.copies(u, update, length, moved, None if apart is None else apart[k])
                   for k, (u, length) in enumerate(taken)):
            return update
        counters["copies"] += 1
        log.warning("update of %s counts none of its samples: it is a copy of one the round took before it",
                    update.device)
        return dataclasses.replace(update, num_samples=0)

    def taken_rows_of(self, global_weights: np.ndarray, taken: Sequence[tuple[ClientUpdate, float]]
                      ) -> DistancesTo | None:
        """What `copied` measures a round's later updates against: `taken`'s rows as changes from the global
        model, where the copy check runs and they fit (`DistancesTo.fits`)."""
        if not self.copy_factor or not taken or not DistancesTo.fits(len(taken), global_weights.size):
            return None
        return DistancesTo([update.weights for update, _ in taken], global_weights)

    def bounded(self, global_weights: np.ndarray, update: ClientUpdate, moved: float, cap: float, lower: float,
                upper: float, counters: Counter[str], reference: ClassReference | None = None,
                typical_count: float | None = None) -> ClientUpdate | None:
        """One update within a sample cap and distance bounds (`moved`: its distance from the global model); None
        when it is rejected. Where the round's calibration reference vouches for it (`vouched`), an update a size
        bound would reject is kept at that bound instead: its claim capped, its change clipped onto the bound, a
        short step kept as it is (`vouched`)."""
        over = update.num_samples > cap and self.sample_bound == "reject"
        short = update.num_samples > 0 and moved < lower
        far = moved > upper and self.norm_bound == "reject"
        if (over or short or far) and self.vouched(global_weights, update, reference, typical_count):
            counters["vouched"] += 1
            log.info("update of %s kept at the bounds: it claims %d samples (cap %d) and moved the model %.3g "
                     "(bounds %.3g to %.3g), and lowers the calibration loss of what it trained on",
                     update.device, update.num_samples, int(min(cap, 2**62)), moved, lower, upper)
            return self._within(global_weights, update, moved, cap, upper)
        if over:
            counters["samples-rejected"] += 1
            log.warning("update of %s dropped: it claims %d samples, more than %d", update.device,
                        update.num_samples, int(cap))
            return None
        if update.num_samples > cap:
            counters["samples-capped"] += 1
            log.warning("%s claimed %d samples: counted as %d", update.device, update.num_samples, int(cap))
        if short:
            counters["free-rider"] += 1
            log.warning("update of %s dropped: it claims %d samples but moved the model %.3g, under %.3g (a free "
                        "rider)", update.device, update.num_samples, moved, lower)
            return None
        if far:
            counters["norm-rejected"] += 1
            log.warning("update of %s dropped: %.3g from the global model, the bound is %.3g", update.device, moved,
                        upper)
            return None
        if moved > upper:
            counters["clipped"] += 1
            log.warning("update of %s clipped: %.3g from the global model, the bound is %.3g", update.device, moved,
                        upper)
        return self._within(global_weights, update, moved, cap, upper)

    @staticmethod
    def _within(global_weights: np.ndarray, update: ClientUpdate, moved: float, cap: float,
                upper: float) -> ClientUpdate:
        """The update, its claim at most `cap` and its change at most `upper` long (scaled back onto it)."""
        if update.num_samples > cap:
            update = dataclasses.replace(update, num_samples=int(cap))
        if moved <= upper:
            return update
        return dataclasses.replace(update, weights=within_length(global_weights, update.weights, upper, moved))

    def vouched(self, global_weights: np.ndarray, update: ClientUpdate, reference: ClassReference | None,
                typical_count: float | None = None) -> bool:
        """Whether the calibration reference vouches for an update a size bound would reject (`reference_vouches`): it
        lowers the calibration loss of what it trained on, as sent, by at least what `trusted` asks of its claim to
        count it all (`trust_margin` x its claim in typical claims, at least `trust_margin`), beyond what each of
        VOUCH_NOISE_STEPS random steps as long as its change does there (`noise_steps`). The size bounds compare a
        device with the round's median, and in small fleets of skewed data honest devices fall outside them (issue 56:
        a device with ten times the data of the median one, one that moved three times as far on classes no other
        holds, one with little data that moved little); the reference tells those from an update that learnt nothing
        (the global model sent back) or one scaled past what it learnt (which raises the loss). The random steps,
        because far beyond the bound noise lowers the loss of a new task's classes too, on which the global model is
        confidently wrong, by as much as a random direction happens to (`boosted`, noise 4x an honest update's length:
        vouched for in 1-4 of its 15 rounds, -3.8 points at 1 of 4, before them; five random steps 4x a joiner's
        length: -0.83 to +0.09 nats, the joiner's own update -2.15): a test of the update against noise, which noise
        passes with chance 1 / (VOUCH_NOISE_STEPS + 1). A change in the direction of the fleet's would not tell them
        apart (the honest device that joins with a new class points away from one that replays the old ones: cosine
        -0.64). Kept at the bound, such an update does no more than one an attacker may send within the bounds."""
        change = self.compared(update, reference) if self.reference_vouches else None
        required = self.required(update, typical_count)
        if reference is None or change is None or change.net > -required:  # compared: None without a reference
            return False
        return all(change.net <= min(reference.loss_change(dataclasses.replace(update, weights=noise)).net, 0.0)
                   - required for noise in noise_steps(global_weights, update.weights, VOUCH_NOISE_STEPS))

    def required(self, update: ClientUpdate, typical_count: float | None) -> float:
        """The nats an update must lower its mix's calibration loss by to count all its samples: `trust_margin`
        times its claim in the round's typical claims, at least `trust_margin`."""
        claimed = update.num_samples / typical_count if typical_count else 1.0
        return self.trust_margin * max(1.0, claimed)

    def directed(self, widened: UpdateChanges, update: ClientUpdate, total: np.ndarray, counters: Counter[str],
                 leave_out: bool, typical_distance: float | None = None) -> ClientUpdate | None:
        """The update when its change points at least `min_alignment` (cosine) the way of the others' (the sum of
        the round's changes so far, `total`, less its own when it is in it: `leave_out`). Else, by
        `direction_bound`: refused (`misaligned`), or its component along the others' raised until it does
        (`turned`; a new array): what pointed against them is taken out, what is new to them (orthogonal) stays,
        at most as long as the round's `typical_distance` (an update that disagreed with the round gets a typical
        update's reach, not more: a reversed update 2.5x as long kept 2.5x its own direction, issue 56)."""
        cosine = alignment(widened, update.weights, total, leave_out)
        if cosine is None or cosine >= self.min_alignment:
            return update
        if self.direction_bound == "reject":
            counters["misaligned"] += 1
            log.warning("update of %s dropped: it points %+.2f (cosine) the way of the round's others, under %+.2f",
                        update.device, cosine, self.min_alignment)
            return None
        counters["turned"] += 1
        log.warning("update of %s turned: it pointed %+.2f (cosine) the way of the round's others, under %+.2f",
                    update.device, cosine, self.min_alignment)
        return dataclasses.replace(update, weights=turned(widened.global_weights, update.weights, total, leave_out,
                                                          self.min_alignment, typical_distance))


def change_sum(widened: UpdateChanges, updates: Sequence[ClientUpdate]) -> np.ndarray:
    """sum_k (w_k - g) in float64."""
    total = np.zeros(widened.global_weights.size, dtype=np.float64)
    for update in updates:
        add_change(total, widened, update.weights)
    return total


def add_change(total: np.ndarray, widened: UpdateChanges, weights: np.ndarray) -> None:
    np.add(total, widened.of(weights), out=total)


COPY_MARGIN = 1e-9  # `UpdateBounds.copies` measures a pair whose lengths differ by at most (1 + this) x its bound
VOUCH_NOISE_SEED = 56  # the random steps `vouched` compares an update with: the same for every update and round
VOUCH_NOISE_STEPS = 19  # as many: an update that is itself noise beats them all about once in 20


def noise_steps(global_weights: np.ndarray, weights: np.ndarray, count: int) -> Iterator[np.ndarray]:
    """`count` models g + |w - g| u, each u a random unit direction (VOUCH_NOISE_SEED): steps as long as the
    update's that learnt nothing, one at a time. Float64 inside, float32 out."""
    rng = np.random.default_rng(VOUCH_NOISE_SEED)
    length = distance(global_weights, weights)
    for _ in range(count):
        direction = rng.standard_normal(weights.size)
        unit_length = math.sqrt(float(np.einsum("i,i->", direction, direction)))  # einsum, not BLAS: `distance`
        yield (global_weights + direction * (length / unit_length)).astype(np.float32)


def alignment(widened: UpdateChanges, weights: np.ndarray, total: np.ndarray, leave_out: bool) -> float | None:
    """cos(w - g, total - (w - g) if leave_out else total); None when either is zero (einsum, not BLAS: `distance`
    in coordinator/compute.py)."""
    own = widened.squared(weights)
    change = widened.of(weights)
    rest = total - change if leave_out else total
    dot = float(np.einsum("i,i->", change, rest))
    others = float(np.einsum("i,i->", rest, rest))
    if own == 0 or others == 0:
        return None
    return dot / math.sqrt(own * others)


def turned(global_weights: np.ndarray, weights: np.ndarray, total: np.ndarray, leave_out: bool,
           cosine: float, longest: float | None = None) -> np.ndarray:
    """g + d', with d = w - g written as p u + r (u the unit direction of the others' changes: `total`, less d when
    `leave_out`; r orthogonal to u) and d' = p' u + r, p' chosen so that cos(d', u) = `cosine` (< 0: p' =
    cosine |r| / sqrt(1 - cosine^2); 0: the part along u removed), then scaled onto `longest` when longer. Float64
    inside, float32 out."""
    change = weights.astype(np.float64) - global_weights
    others = total - change if leave_out else total
    unit = others / math.sqrt(float(np.einsum("i,i->", others, others)))
    along = float(np.einsum("i,i->", change, unit))  # einsum, not BLAS's dot: see `distance`
    across = math.sqrt(max(float(np.einsum("i,i->", change, change)) - along * along, 0.0))
    wanted = cosine * across / math.sqrt(1.0 - cosine * cosine)
    change += (wanted - along) * unit
    length = math.sqrt(float(np.einsum("i,i->", change, change)))
    if longest is not None and length > longest > 0:
        change *= longest / length
    return (global_weights + change).astype(np.float32)


class BoundedStream:
    """The bounds for a rule that folds (module docstring): `add` each update as it arrives; each one within the
    bounds is passed to `take`, the first `hold` of them only once `hold` have come or at `close`."""

    def __init__(self, bounds: UpdateBounds, global_weights: np.ndarray, take: Callable[[ClientUpdate], None],
                 counters: Counter[str], reference: ClassReference | None = None,
                 path: FleetPath = UNKNOWN_PATH, heads: HeadLayout | None = None) -> None:
        self.bounds = bounds
        self.reference = reference
        self.path = path
        self.widened = UpdateChanges(global_weights)  # each update's change, widened once for every bound
        self.influence = bounds.influence(self.widened, path, heads)
        self.global_weights = global_weights
        self.take = take
        self.counters = counters
        self.counts = RunningTypical()
        self.distances = RunningTypical()
        self.changes = RunningMedian()  # the calibration loss changes of the updates the reference passed
        self.held: list[tuple[ClientUpdate, float]] | None = []  # and their distances; None once they went on
        self.held_learnt = 0  # of them, those that learnt something (`learnt_nothing`): `hold` of these are waited for
        # the direction check's reference: the changes of the updates taken so far
        self.total = np.zeros(global_weights.size, np.float64) if bounds.checks_direction else None
        # past the held updates, for the later ones
        self.selection = bounds.selection(reference, heads, global_weights)
        self.sent: list[tuple[ClientUpdate, float]] = []  # the held updates as sent, and their distances
        self.sent_rows: DistancesTo | None = None  # their rows, which a later update is measured against at once

    def add(self, update: ClientUpdate) -> None:
        moved = self.widened.length(update.weights) if self.bounds.measures_distance else 0.0
        self.counts.add(update.num_samples)
        self.distances.add(moved)
        if self.held is not None:
            if learnt_nothing(update, self.global_weights):
                # held with the first ones, as the global model's own array (it holds no memory of its own), and not
                # counted among them: Krum's reference and the copy check's are the first `hold` that learnt something
                self.held.append((dataclasses.replace(update, weights=self.global_weights), moved))
                return
            self.held.append((update, moved))
            self.held_learnt += 1
            if self.held_learnt >= self.bounds.hold:
                self._release()
            return
        bounded = self.bounds.bounded(
            self.global_weights, update, moved, self.bounds.sample_cap(self.counts),
            *self.bounds.distance_bounds(self.distances.value()), self.counters, self.reference,
            self.counts.value(),
        )
        if bounded is not None:
            bounded = self.bounds.progressing(self.widened, bounded, self.path.last_step, self.counters)
        if bounded is not None:
            change = self.bounds.compared(bounded, self.reference)
            self.bounds.add_change(self.changes, change)
            bounded = self.bounds.referenced(bounded, self.reference, self.counters, self.counts.value(),
                                             self.changes.value(), change)
        if bounded is not None:
            bounded = self.bounds.copied(bounded, moved, self.sent, self.counters, self.sent_rows, self.widened)
        if bounded is None or not self.selection.takes(bounded, self.counters, self.widened):
            return
        if self.total is not None:
            bounded = self.bounds.directed(self.widened, bounded, self.total, self.counters, False,
                                           self.distances.value())
        if bounded is not None:
            self._take(bounded if self.influence is None else self.influence.bound([bounded], self.counters)[0])

    def close(self) -> None:
        """The round is over: the held updates (a round of fewer than `hold`) go on, bounded together."""
        if self.held is not None:
            self._release()

    def _take(self, update: ClientUpdate) -> None:
        if self.total is not None:
            add_change(self.total, self.widened, update.weights)
        self.take(update)

    def _release(self) -> None:
        """The held updates, bounded together in device order (the order they arrived in is the network's: in
        device order the same round is bounded and folded alike on any host)."""
        held, self.held = sorted(self.held or [], key=lambda item: item[0].device), None
        updates = [update for update, _ in held]
        if self.bounds.copy_factor:  # a later copy of one of them counts none of its samples: kept for the round
            # (one that claims no samples is no copy: `counted_once`; and the rows stay `hold` at most)
            self.sent = [(u, d) for u, d in held if u.num_samples > 0]
            self.sent_rows = self.bounds.taken_rows_of(self.global_weights, self.sent)
        for update in self.bounds.apply(self.global_weights, updates, self.counters, [d for _, d in held],
                                        self.selection, self.reference, self.path, influence=self.influence,
                                        changes=self.changes, widened=self.widened, taken_rows=self.sent_rows):
            self._take(update)
