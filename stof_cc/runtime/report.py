"""Pictures and an index of a compiled model's fusion groups, written beside the `.cu` files.

* ``fusion.dot``: Graphviz source, one cluster per group (anchors in bold, groups torch runs
  dashed); rendered to ``fusion_dot.svg`` when the ``dot`` program is installed;
* ``fusion.svg``: a drawing that needs nothing installed: the graph's computed nodes in
  topological layers (networkx), one colour per group, anchors outlined, torch groups grey;
* ``index.html``: every group with its kind, anchor, fused ops, template, parameters, the
  model's estimate and the measured time from the tuning database when there is one, each
  linked to its `.cu`, with the picture on top.
"""

from __future__ import annotations

import html
import shutil
import subprocess
from pathlib import Path

import networkx as nx

from stof_cc.ir.graph import Graph
from stof_cc.passes.fusion import FusionPlan
from stof_cc.runtime.build import GroupBuild

PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
           "#bc80bd", "#ccebc5", "#ffed6f", "#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#ffff99")
TORCH_COLOUR = "#d9d9d9"
BOX_W, BOX_H, GAP_X, GAP_Y = 150, 34, 24, 46


def _colours(builds: list[GroupBuild]) -> dict[str, str]:
    return {b.group.name: (PALETTE[i % len(PALETTE)] if b.template else TORCH_COLOUR) for i, b in enumerate(builds)}


def fusion_dot(graph: Graph, builds: list[GroupBuild]) -> str:
    colours = _colours(builds)
    lines = [f'digraph "{graph.name}" {{', "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];']
    for b in builds:
        style = "rounded,filled" if b.template else "rounded,filled,dashed"
        label = f"{b.group.name}: {b.template or 'torch'}"
        lines.append(f'  subgraph "cluster_{b.group.name}" {{ label="{label}"; style="{style}"; '
                     f'fillcolor="{colours[b.group.name]}";')
        for name in b.group.nodes:
            bold = ", penwidth=2.5" if name == b.group.anchor else ""
            lines.append(f'    "{name}" [label="{name}\\n{graph.node(name).op}", fillcolor="white"{bold}];')
        lines.append("  }")
    computed = {n for b in builds for n in b.group.nodes}
    for src, dst in graph.nx_graph.edges:
        if src in computed and dst in computed:
            lines.append(f'  "{src}" -> "{dst}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def fusion_svg(graph: Graph, builds: list[GroupBuild]) -> str:
    """The computed nodes in topological layers, coloured by group."""
    colours = _colours(builds)
    group_of = {n: b for b in builds for n in b.group.nodes}
    dag = graph.nx_graph.subgraph(group_of).copy()
    layers = list(nx.topological_generations(dag))
    position = {}
    for row, layer in enumerate(layers):
        for col, name in enumerate(sorted(layer, key=lambda n: group_of[n].group.name)):
            position[name] = (GAP_X + col * (BOX_W + GAP_X), GAP_Y + row * (BOX_H + GAP_Y))
    width = GAP_X + max((len(layer) for layer in layers), default=1) * (BOX_W + GAP_X)
    height = GAP_Y + len(layers) * (BOX_H + GAP_Y)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="10">',
           '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="7" refY="3" orient="auto">'
           '<path d="M0,0 L7,3 L0,6 z" fill="#555"/></marker></defs>']
    for src, dst in dag.edges:
        (x1, y1), (x2, y2) = position[src], position[dst]
        out.append(f'<line x1="{x1 + BOX_W / 2}" y1="{y1 + BOX_H}" x2="{x2 + BOX_W / 2}" y2="{y2}" '
                   'stroke="#555" marker-end="url(#arrow)"/>')
    for name, (x, y) in position.items():
        build = group_of[name]
        anchor = name == build.group.anchor
        title = html.escape(f"{name} ({graph.node(name).op}) in {build.group.name}: {build.template or build.note}")
        stroke = f'stroke="{"#000" if anchor else "#777"}" stroke-width="{2.5 if anchor else 1}"'
        dashes = "" if build.template else ' stroke-dasharray="4 2"'
        out.append(f'<g><title>{title}</title>'
                   f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="6" '
                   f'fill="{colours[build.group.name]}" {stroke}{dashes}/>'
                   f'<text x="{x + 6}" y="{y + 14}">{html.escape(build.group.name)} {html.escape(name[:16])}</text>'
                   f'<text x="{x + 6}" y="{y + 27}">{html.escape(graph.node(name).op[:20])}</text></g>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def index_html(graph: Graph, plan: FusionPlan, builds: list[GroupBuild], picture: str) -> str:
    colours = _colours(builds)
    rows = []
    for b in builds:
        fused = ", ".join(n for n in b.group.nodes if n != b.group.anchor) or "-"
        source = (f'<a href="{html.escape(b.path.name)}">{html.escape(b.path.name)}</a>' if b.path
                  else html.escape(b.note))
        estimate = f"{b.estimate_us:.1f}" if b.estimate_us is not None else "-"
        measured = f"{b.measured_us:.1f}" if b.measured_us is not None else "not tuned"
        rows.append(f'<tr><td style="background:{colours[b.group.name]}">{b.group.name}</td><td>{b.group.kind}</td>'
                    f"<td>{html.escape(b.group.anchor or '-')}</td><td>{html.escape(fused)}</td>"
                    f"<td>{html.escape(b.template or 'torch')}</td>"
                    f"<td>{html.escape(str(b.params) if b.params else '-')}</td><td>{estimate}</td>"
                    f"<td>{measured}</td><td>{source}</td></tr>")
    alternatives = "".join(f"<li>{html.escape(line)}</li>"
                           for line in plan.choices or [label for label, _ in plan.alternatives]) or "<li>none</li>"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>stof-cc: {html.escape(graph.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #999;padding:4px 8px;font-family:monospace;font-size:12px}}</style></head>
<body><h1>{html.escape(graph.name)}: {len(builds)} fusion groups</h1>
<p>{sum(1 for b in builds if b.template)} groups have a generated kernel; grey (dashed) groups run through torch.
Anchors are outlined. Estimates are stage 1 of the search (microseconds); measured times come from the tuning
database.</p>
<p><img src="{html.escape(picture)}" alt="fusion groups of {html.escape(graph.name)}"></p>
<table><tr><th>group</th><th>kind</th><th>anchor</th><th>fused ops</th><th>template</th><th>parameters</th>
<th>estimate (us)</th><th>measured (us)</th><th>source</th></tr>
{chr(10).join(rows)}
</table>
<h2>Alternative fusion schemes (stage 1's choice)</h2><ul>{alternatives}</ul>
</body></html>
"""


def write_report(graph: Graph, plan: FusionPlan, builds: list[GroupBuild], out_dir: Path) -> list[Path]:
    """fusion.dot, fusion.svg (and fusion_dot.svg with graphviz) and index.html in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (("fusion.dot", fusion_dot(graph, builds)), ("fusion.svg", fusion_svg(graph, builds))):
        (out_dir / name).write_text(text)
        written.append(out_dir / name)
    picture = "fusion.svg"
    if shutil.which("dot"):
        subprocess.run(["dot", "-Tsvg", "-o", str(out_dir / "fusion_dot.svg"), str(out_dir / "fusion.dot")], check=True)
        written.append(out_dir / "fusion_dot.svg")
        picture = "fusion_dot.svg"
    (out_dir / "index.html").write_text(index_html(graph, plan, builds, picture))
    written.append(out_dir / "index.html")
    return written

