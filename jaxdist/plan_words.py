"""The words every plan is read in, in one place: the terms a predicted step is the sum of
(TIME_TERMS, TimeTerms) and the one rule for which memory figure decides (MEMORY_RULE).
The plan's text, plan.json, analysis.plan_rank and the docs use these; nothing here imports
more than jaxdist.figures, so readers of plans (analysis/) import it without jax."""

from __future__ import annotations

import dataclasses

from jaxdist.figures import Figures

# The one vocabulary every plan's time is read in (plan text, plan.json's `time.terms`,
# analysis.plan_rank), in this order; the terms add up to the predicted step.
# The two link terms are the communication the schedule leaves exposed.
TIME_TERMS = ("compute", "memory-bound kernels", "launches", "intra-node", "inter-node",
              "bubble")


@dataclasses.dataclass(frozen=True)
class TimeTerms(Figures):
    """A predicted step as the sum of TIME_TERMS (seconds per device): the device time split
    into compute-bound kernels, memory-bound kernels (with host copies no kernel hid) and
    launch overheads, the communication the schedule leaves exposed on each link, and the
    pipeline bubble. The roofline times the whole program (or a pipeline op) as one kernel,
    compute- or memory-bound, and models no launches."""
    compute_s: float
    memory_bound_s: float
    launch_s: float
    exposed_intra_node_s: float
    exposed_inter_node_s: float
    bubble_s: float
    launches_modelled: bool

    def seconds(self) -> list[tuple[str, float]]:
        """(term, seconds) in TIME_TERMS order."""
        return list(zip(TIME_TERMS, (self.compute_s, self.memory_bound_s, self.launch_s,
                                     self.exposed_intra_node_s, self.exposed_inter_node_s,
                                     self.bubble_s)))

    @property
    def step_s(self) -> float:
        return sum(s for _, s in self.seconds())

    def bottleneck(self) -> str:
        """The largest term (a TIME_TERMS name)."""
        return max(self.seconds(), key=lambda kv: kv[1])[0]

    def __add__(self, other: "TimeTerms") -> "TimeTerms":
        return self._combine(other, 1.0)

    def __sub__(self, other: "TimeTerms") -> "TimeTerms":
        return self._combine(other, -1.0)

    def _combine(self, other: "TimeTerms", sign: float) -> "TimeTerms":
        return TimeTerms(*(a + sign * b for (_, a), (_, b) in
                           zip(self.seconds(), other.seconds())),
                         launches_modelled=self.launches_modelled or other.launches_modelled)


def roofline_terms(compute: float, hbm: float, device: float, exposed: dict[str, float],
                   bubble: float = 0.0) -> TimeTerms:
    """TimeTerms of a roofline: the device time is compute-bound or memory-bound."""
    bound = {"compute_s": device, "memory_bound_s": 0.0} if compute >= hbm else \
        {"compute_s": 0.0, "memory_bound_s": device}
    return TimeTerms(**bound, launch_s=0.0, exposed_intra_node_s=exposed["intra-node"],
                     exposed_inter_node_s=exposed["inter-node"], bubble_s=bubble,
                     launches_modelled=False)


# Where XLA:GPU's buffer assignment decides the memory verdict: each of its terms within this
# band of the hand estimate's (hand / compiler). The hand estimate is within 5% of every
# published peak it is set beside (experiments.predict --validate); a compiled figure further
# from it than this is a program the extrapolation or XLA's schedule may have made unlike
# what runs (e.g. every block's gathered weights live at once).
MEMORY_BAND = (0.8, 1.25)

# The one rule for which memory figure decides, as every plan states it (the plan's text,
# plan.json's `memory.rule`, docs/glossary.md and docs/predict.md).
MEMORY_RULE = (
    "XLA:GPU's buffer assignment decides where an XLA:GPU program was read (a pipeline: its "
    "fullest stage, with XLA:GPU's working set of one chunk's backward), else the hand "
    "estimate; where the two differ beyond "
    f"{MEMORY_BAND[0]}-{MEMORY_BAND[1]} on a term and fall on either side of HBM, the "
    "verdict is unknown (an upper-bound hand estimate over HBM does not count)")
