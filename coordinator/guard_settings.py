"""The `[guard]` table of the coordinator file: the settings of the bounds on one update, read and checked apart
from the guard that applies them (coordinator/guard.py, whose docstring says what each bound does), so that a
configuration is checked before the guard's numerical machinery (torch) is imported: a typo is refused at once."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

Bounds = TypeVar("Bounds", bound="GuardSettings")

NORM_BOUNDS = ("clip", "reject", "off")
DIRECTION_BOUNDS = ("reject", "project")
SAMPLE_BOUNDS = ("cap", "reject")
REFERENCES = ("off", "classes")
TRUST_MEASURES = ("gained", "net")  # what the trust weight counts of an update's calibration loss change
KRUM_ROUNDS = ("without-reference", "always")
KRUM_COMPARISONS = ("classes", "whole")
WAY_BACK_BOUNDS = ("off", "clip")


# the keys that turn every bound and check off (plain aggregation: a rule's own test, the baseline of a benchmark)
OFF: dict[str, float | str] = {"norm_bound": "off", "sample_factor": 0.0, "free_rider_factor": 0.0, "krum_share": 0.0,
                               "min_alignment": -1.0, "min_progress": -1.0, "reference": "off", "trust_margin": 0.0,
                               "way_back": "off", "row_factor": 0.0, "copy_factor": 0.0,
                               "reference_vouches": False}
# ... and those that leave the bounds on an update's size on (its distance, its claim, the free-rider check) at their
# defaults: a method comparison's guard, and with Krum selection in every round the default before issue 56
SIZE_BOUNDS_ONLY = {key: value for key, value in OFF.items()
                    if key not in ("norm_bound", "sample_factor", "free_rider_factor")}


@dataclass(frozen=True)
class GuardSettings:
    """`[guard]`: the bounds of coordinator/guard.py (its docstring says what each does); the defaults are on."""

    norm_bound: str = "reject"
    norm_factor: float = 3.0
    max_samples: int = 0
    sample_factor: float = 10.0
    sample_rank: float = 0.0  # no claim counts more than the (f+1)-th largest of the round, f = sample_rank x n
    sample_bound: str = "reject"
    free_rider_factor: float = 0.1
    krum_share: float = 0.25
    krum_radius: float = 2.0
    krum_when: str = "without-reference"  # "always": Krum selection in rounds that have a calibration reference too
    krum_compare: str = "classes"  # two updates compared without the head rows of the classes either claims
    krum_floor: float = 0.05  # a named update this near the kept ones' centre (x the round's median distance) stays
    min_alignment: float = -0.9
    direction_bound: str = "reject"
    reference: str = "classes"  # each update compared on its classes' calibration samples (reference.py); "off"
    reference_tolerance: float = 1.0  # nats it may raise its mix's calibration loss above the global model's
    trust_margin: float = 0.05  # nats it must lower that loss by to count all its samples (0: off)
    trust_on: str = "gained"  # "gained": on the parts of its mix it lowered; "net": on its whole mix
    min_progress: float = -0.95  # the least cosine of an update with the fleet's last global step (-1: off)
    way_back: str = "clip"  # no update steps back toward the first global model further than the round's median
    way_back_slack: float = 0.25  # ... plus this x the round's median change length
    row_factor: float = 1.25  # a class's head row at most this times the lower median of its claimants' (0: off)
    copy_factor: float = 0.01  # updates this near each other (x the typical distance) are copies (0: off)
    reference_vouches: bool = True  # an update beyond a size bound that the reference vouches for is kept at it
    hold: int = 8  # a folding rule's first updates of a round, bounded together before any is folded

    def __post_init__(self) -> None:
        if self.norm_bound not in NORM_BOUNDS:
            raise ValueError(f"norm_bound must be one of {', '.join(NORM_BOUNDS)}, got {self.norm_bound!r}")
        if self.direction_bound not in DIRECTION_BOUNDS:
            raise ValueError(f"direction_bound must be one of {', '.join(DIRECTION_BOUNDS)}, got "
                             f"{self.direction_bound!r}")
        if not (self.row_factor == 0 or self.row_factor >= 1):
            raise ValueError(f"row_factor must be 0 (off) or >= 1, got {self.row_factor}")
        if self.way_back not in WAY_BACK_BOUNDS:
            raise ValueError(f"way_back must be one of {', '.join(WAY_BACK_BOUNDS)}, got {self.way_back!r}")
        if not self.way_back_slack >= 0:
            raise ValueError(f"way_back_slack must be >= 0, got {self.way_back_slack}")
        if self.krum_when not in KRUM_ROUNDS:
            raise ValueError(f"krum_when must be one of {', '.join(KRUM_ROUNDS)}, got {self.krum_when!r}")
        if self.krum_compare not in KRUM_COMPARISONS:
            raise ValueError(f"krum_compare must be one of {', '.join(KRUM_COMPARISONS)}, got {self.krum_compare!r}")
        if self.reference not in REFERENCES:
            raise ValueError(f"reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}")
        if not self.reference_tolerance >= 0:
            raise ValueError(f"reference_tolerance must be >= 0, got {self.reference_tolerance}")
        if not 0 <= self.copy_factor < 1:
            raise ValueError(f"copy_factor must be in [0, 1), got {self.copy_factor}")
        if not self.trust_margin >= 0:
            raise ValueError(f"trust_margin must be >= 0, got {self.trust_margin}")
        if self.trust_on not in TRUST_MEASURES:
            raise ValueError(f"trust_on must be one of {', '.join(TRUST_MEASURES)}, got {self.trust_on!r}")
        if self.sample_bound not in SAMPLE_BOUNDS:
            raise ValueError(f"sample_bound must be one of {', '.join(SAMPLE_BOUNDS)}, got {self.sample_bound!r}")
        if not self.norm_factor >= 1 or self.max_samples < 0 or not self.sample_factor >= 0 or self.hold < 1 \
                or not self.krum_radius >= 0 or not self.krum_floor >= 0:
            raise ValueError("norm_factor must be >= 1, max_samples >= 0, sample_factor >= 0, hold >= 1, "
                             "krum_radius >= 0 and krum_floor >= 0")
        if not 0 <= self.sample_rank < 0.5:
            raise ValueError(f"sample_rank must be in [0, 0.5), got {self.sample_rank}")
        if not 0 <= self.free_rider_factor < 1 or not 0 <= self.krum_share < 0.5 or not -1 <= self.min_alignment < 1:
            raise ValueError("free_rider_factor must be in [0, 1), krum_share in [0, 0.5) and min_alignment in "
                             "[-1, 1)")
        if not -1 <= self.min_progress < 1:
            raise ValueError(f"min_progress must be in [-1, 1), got {self.min_progress}")

    @classmethod
    def only(cls: type[Bounds], **on: float | str | int) -> Bounds:
        """Every bound and check off (`OFF`) but those given."""
        return cls(**{**OFF, **on})  # type: ignore[arg-type]

    @property
    def measures_distance(self) -> bool:
        return self.norm_bound != "off" or self.free_rider_factor > 0 or self.copy_factor > 0

    @property
    def checks_direction(self) -> bool:
        return self.min_alignment > -1

    @property
    def checks_progress(self) -> bool:
        return self.min_progress > -1

    @property
    def checks_way_back(self) -> bool:
        return self.way_back != "off"

    @property
    def checks(self) -> tuple[str, ...]:
        """The keys of every bound and check that is on: each judges one update at a time (secure aggregation, which
        shows the coordinator none, refuses them)."""
        on = [key for key, off in OFF.items() if key != "reference_vouches" and getattr(self, key) != off]
        if self.reference == "off" and "trust_margin" in on:  # a margin on a reference that is off checks nothing
            on.remove("trust_margin")
        return (*on, *(("max_samples",) if self.max_samples else ()))

    @property
    def comparing(self) -> tuple[str, ...]:
        """The keys of the bounds that judge an update against the round's others (a median, a sum, a selection),
        so that one device's update can change what is kept of the others': central DP's noise must then cover the
        whole released change, not one update's share of a sum (coordinator/privacy.py). Not the sample bounds:
        under central DP every update claims one sample."""
        on = {"norm_bound": self.norm_bound != "off", "free_rider_factor": self.free_rider_factor > 0,
              "krum_share": self.krum_share > 0, "min_alignment": self.checks_direction,
              "way_back": self.checks_way_back, "row_factor": self.row_factor > 0, "copy_factor": self.copy_factor > 0,
              "trust_margin": self.reference != "off" and self.trust_margin > 0}
        return tuple(key for key, comparing in on.items() if comparing)
