"""How cost grows with the rank count R and the tokens per rank T, at one shape: time per call,
fraction of the physical limit and memory per rank, one `moed bench dispatch` process per point
(peak RSS is a process's), drawn as one SVG (docs/benchmarks.md, "How cost grows").

    python3 bench/python/growth.py --moed build/bin/moed --ranks 2,4,8 --tokens 64,256 \\
        --shape mixtral --svg growth.svg --json growth.json

Memory per rank is the process's peak RSS over R (the threads world is one process; under
`--world mpi` rank 0's process, which also rebuilds every rank's inputs and the reference), and
the parts the bench names: the dispatcher's resident growth (its buffers and outputs), the
inputs, the reference and the STREAM arrays, each over R. Points whose inputs and reference
would pass --max-gb are skipped (said on stderr).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

SHAPES = {"tiny": (64, 256, 8, 2), "mixtral": (2048, 4096, 8, 2), "dsv3": (4096, 7168, 256, 8),
          "decode": (128, 7168, 256, 8)}
COLOURS = ["#440154", "#3b528b", "#21918c", "#5ec962", "#d8a800", "#b5367a"]


def run_point(a, R, T):
    with tempfile.TemporaryDirectory(prefix="moed-growth-") as tmp:
        out = os.path.join(tmp, "records.json")
        cmd = [a.moed, "bench", "dispatch", "--dispatcher", a.dispatcher, "--ranks", str(R),
               "--shape", a.shape, "--tokens", str(T), "--iters", str(a.iters), "--json-out", out]
        env = None
        if a.world == "mpi":
            cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(R)] + cmd + \
                ["--world", "mpi"]
            env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        print("$", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        records = json.load(open(out))
    point = {"ranks": R, "tokens": T}
    for r in records:
        p = r["phase"]
        point[f"{p}_ms"] = r["seconds"] * 1e3
        point[f"{p}_fraction"] = r["fraction_of_limit"]
        point[f"{p}_verified"] = r["verified"]
        m = r["memory"]
        # The threads world is one process; under MPI the figure is rank 0's process.
        per_process = R if a.world == "threads" else 1
        point["peak_rss_mb_per_rank"] = r["peak_rss_bytes"] / per_process / 1e6
        point["dispatcher_mb_per_rank"] = m["dispatcher_rss_bytes"] / R / 1e6
        point["inputs_mb_per_rank"] = m["inputs_bytes"] / R / 1e6
        point["reference_mb_per_rank"] = m["reference_bytes"] / R / 1e6
        point["stream_mb_per_rank"] = m["stream_bytes"] / R / 1e6
        # What a rank must hold at least: its tokens and the rows it receives.
        point["data_mb_per_rank"] = (r["model_read_bytes"] + r["model_write_bytes"]) / R / 1e6 \
            if p == "dispatch" else point.get("data_mb_per_rank", 0)
    return point


def svg(points, a):
    """Three panels over log2 R: ms per call, fraction of the limit, MB per rank; one colour
    per T; dispatch solid, combine dashed; memory: peak RSS solid, the dispatcher's dashed."""
    W, H, pw, ph, left, top = 1080, 380, 280, 250, 60, 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" font-size="15" text-anchor="middle" font-weight="bold">'
           f'{a.dispatcher}, {a.shape} (H and K fixed, E moved up to R), {a.world} world: how cost grows with R and T'
           f'</text>']
    ranks = sorted({p["ranks"] for p in points})
    tokens = sorted({p["tokens"] for p in points})
    x0, x1 = math.log2(ranks[0]), math.log2(ranks[-1]) if len(ranks) > 1 else math.log2(ranks[0]) + 1
    panels = [("time per call, ms (log)", ["dispatch_ms", "combine_ms"], True),
              ("fraction of the limit", ["dispatch_fraction", "combine_fraction"], False),
              ("memory per rank, MB (log)", ["peak_rss_mb_per_rank", "dispatcher_mb_per_rank"], True)]
    for i, (title, keys, log) in enumerate(panels):
        px = left + i * (pw + 80)
        vals = [p[k] for p in points for k in keys if p.get(k, 0) > 0]
        lo, hi = (min(vals), max(vals)) if vals else (1, 10)
        if log:
            lo, hi = 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
            ticks = [10 ** e for e in range(int(math.log10(lo)), int(math.log10(hi)) + 1)]
            fy = lambda v: top + ph - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * ph
        else:
            lo, hi = 0.0, max(1.0, math.ceil(hi * 5) / 5)
            ticks = [j / 5 * hi for j in range(6)]
            fy = lambda v: top + ph - (v - lo) / (hi - lo) * ph
        fx = lambda r: px + (math.log2(r) - x0) / (x1 - x0) * pw
        out.append(f'<text x="{px + pw / 2}" y="{top - 10}" text-anchor="middle" '
                   f'font-weight="bold">{title}</text>')
        out.append(f'<rect x="{px}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
        for t in ticks:
            y = fy(t)
            out.append(f'<line x1="{px}" y1="{y:.1f}" x2="{px + pw}" y2="{y:.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{px - 4}" y="{y + 4:.1f}" text-anchor="end">{t:g}</text>')
        for r in ranks:
            x = fx(r)
            out.append(f'<text x="{x:.1f}" y="{top + ph + 15}" text-anchor="middle">{r}</text>')
        out.append(f'<text x="{px + pw / 2}" y="{top + ph + 30}" text-anchor="middle">ranks R</text>')
        for c, T in enumerate(tokens):
            colour = COLOURS[c % len(COLOURS)]
            for k, dash in zip(keys, ["", ' stroke-dasharray="5,3"']):
                pts = [(fx(p["ranks"]), fy(p[k])) for p in sorted(points, key=lambda p: p["ranks"])
                       if p["tokens"] == T and p.get(k, 0) > 0]
                if not pts:
                    continue
                path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
                out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" '
                           f'stroke-width="2"{dash}/>')
                for x, y in pts:
                    out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{colour}"/>')
    ly = H - 22
    rss = "peak RSS / R" if a.world == "threads" else "rank 0's peak RSS"
    for c, T in enumerate(tokens):
        colour = COLOURS[c % len(COLOURS)]
        x = left + c * 110
        out.append(f'<line x1="{x}" y1="{ly}" x2="{x + 24}" y2="{ly}" stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{x + 30}" y="{ly + 4}">T = {T}</text>')
    out.append(f'<text x="{left + len(tokens) * 110 + 10}" y="{ly + 4}">solid: dispatch; dashed: '
               f'combine (memory: solid {rss}, dashed the dispatcher\'s own growth / R)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moed", default="build/bin/moed")
    p.add_argument("--dispatcher", default="flex")
    p.add_argument("--world", default="threads", choices=["threads", "mpi"],
                   help="threads: one process of R rank threads; mpi: R processes (mpirun)")
    p.add_argument("--shape", default="mixtral", choices=sorted(SHAPES))
    p.add_argument("--ranks", default="2,4,8,16,32,64")
    p.add_argument("--tokens", default="128,512,2048")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--max-gb", type=float, default=6.0,
                   help="skip points whose inputs, outputs and reference pass this")
    p.add_argument("--json", help="write the points here")
    p.add_argument("--svg", help="write the picture here")
    a = p.parse_args()
    _, hidden, _, k = SHAPES[a.shape]
    points = []
    for T in [int(t) for t in a.tokens.split(",")]:
        for R in [int(r) for r in a.ranks.split(",")]:
            # Inputs, reference and dispatcher outputs: about (1 + 3 K) rows of T per rank.
            gb = R * T * hidden * 2 * (1 + 3 * k) / 1e9
            if gb > a.max_gb:
                print(f"growth: R={R} T={T} skipped (about {gb:.1f} GB > --max-gb {a.max_gb})",
                      file=sys.stderr)
                continue
            points.append(run_point(a, R, T))
            print(json.dumps(points[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(points, f, indent=1)
    if a.svg:
        with open(a.svg, "w") as f:
            f.write(svg(points, a))


if __name__ == "__main__":
    main()
