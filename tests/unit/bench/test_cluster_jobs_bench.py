"""tools/bench/cluster_jobs.py's figures: ratios paired within a round, median with its spread."""

from tools.bench.cluster_jobs import JobRun, paired_ratios, spread


def run(cpu_s: float, wall_s: float = 1.0, sentences: int = 100) -> JobRun:
    return JobRun(sentences, wall_s, cpu_s / 2, cpu_s / 2, 10.0, {})


def test_ratios_are_paired_round_by_round_and_reported_as_median_and_spread():
    runs = {1: [run(1.0), run(2.0), run(1.0)], 4: [run(1.1), run(2.0), run(1.5)]}
    ratios = paired_ratios(runs, 1, "cpu_ms_per_sentence")
    assert ratios[1] == [1.0, 1.0, 1.0]
    assert [round(r, 6) for r in ratios[4]] == [1.1, 1.0, 1.5]  # a slow round 2 moves neither figure
    assert spread(ratios[4]) == (ratios[4][0], 1.0, 1.5)
    assert run(1.0).cpu_ms_per_sentence == 10.0 and run(1.0, wall_s=0.5).sentences_per_s == 200.0
