"""giaannd from Python: a local cluster, training, evaluation, generation, one column, a report.

    python docs/examples/quickstart.py [REPORT.html] [--sentences N]

Starts 2 storage daemons and 1 compute daemon on loopback (real processes, as ``make demo``
does), trains on the first N sentences of the bundled corpus with a progress bar, evaluates
top-1 on unseen prompts before and after (and on sentences it trained on), generates text, prints the strongest connections of
one concept column, writes the HTML report and stops the cluster (also on an error or Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import giaannd

HELD_OUT = [
    "In the beginning God created the heaven and the earth.",
    "The people of the city went to the house of the king.",
    "And the man said unto the woman, what is this that thou hast done?",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", nargs="?", default="giaannd-report.html", help="where to write the report")
    ap.add_argument("--sentences", type=int, default=300, help="sentences to train on (default 300)")
    args = ap.parse_args(argv)

    with giaannd.LocalCluster(storage=2, compute=1) as client:
        print("members:", ", ".join(f"{m['name']} ({m['status']})" for m in client.members()))

        before = client.eval(HELD_OUT, constants="test")
        job = client.train(giaannd.bundled_corpus(), limit=args.sentences)
        figures = job.wait(progress=True)
        print(f"trained {figures['trained']} sentences at {figures['sentences_per_s']} sentences/s")

        after = client.eval(HELD_OUT, constants="test")
        seen = client.eval(limit=50)  # the daemon's default set: the first bundled sentences, trained on
        print(f"top-1 on {after['prompts']} unseen prompts: {before['top1']:.3f} before training, "
              f"{after['top1']:.3f} after; {seen['top1']:.3f} on {seen['prompts']} sentences it trained on")

        text = client.generate("In the beginning, God created the heavens", max_tokens=5)
        print("generated:", text or "(nothing: no connection of the last token's column fired)")

        column = client.column("god")
        print(f"column 'god': {len(column.features['feature'])} feature neurons, {len(column)} connections")
        for source, target_column, target_feature, strength in column.strongest(5):
            print(f"  {source:>12} -> {target_feature} (in column {target_column}): {strength:g}")

        path = client.report(Path(args.report))
        print(f"report written to {path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
