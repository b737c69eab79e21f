"""Confidence intervals for the Python benchmarks' figures, so a verdict says whether a target
is met, missed, or cannot be told from the noise of this run.

A figure is a median (of paired differences, or of per-round ratios); its interval is the
percentile bootstrap: the median of `resamples` resamplings with replacement, seeded, so the
same samples give the same interval.
"""
import random
import statistics


def median_ci(samples, level=0.95, resamples=2000, seed=1):
    """(median, low, high) of `samples`; low and high bound the `level` interval."""
    xs = list(samples)
    if not xs:
        nan = float("nan")
        return nan, nan, nan
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    lo = meds[int(tail * (resamples - 1))]
    hi = meds[int((1.0 - tail) * (resamples - 1))]
    return statistics.median(xs), lo, hi


def balanced_median_ci(first, second, level=0.95, resamples=2000, seed=1):
    """(estimate, low, high) of the mean of two medians: of the samples taken in one order
    (A then B) and in the other (B then A). Whichever ran second may find the caches the
    first left behind, which shifts each half's median by the same amount the other way; the
    mean of the two cancels that, where the median of the pooled samples would sit anywhere
    between the two modes."""
    a, b = list(first), list(second)
    if not a or not b:
        return median_ci(a + b, level, resamples, seed)
    rng = random.Random(seed)
    est = sorted((statistics.median(rng.choices(a, k=len(a))) +
                  statistics.median(rng.choices(b, k=len(b)))) / 2 for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    return ((statistics.median(a) + statistics.median(b)) / 2, est[int(tail * (resamples - 1))],
            est[int((1.0 - tail) * (resamples - 1))])


def verdict(low, high, limit):
    """Against an upper limit: 'met' when the whole interval is at or below it, 'missed' when
    the whole interval is above it, 'undecided' when the interval straddles it."""
    if high <= limit:
        return "met"
    if low > limit:
        return "missed"
    return "undecided"
