"""`inspect`: one row per call site with its source position, shapes and split annotation."""
from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table

from ..errors import display_path, package_path
from ..graph.graph import Graph, Site


def _shape(shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def _callee(name: str) -> str:
    return name.replace("torch.nn.functional.", "F.").replace("torch.nn.", "nn.")


def _splittable(site: Site) -> list[str]:
    if site.dims is None:
        return []
    sizes = site.dims.sizes()
    out = []
    for label in site.dims.splittable():
        mark = "+" if label in site.dims.reduced else ""
        impl = f" via {site.dims.impl[label].split('(')[0]}" if label in site.dims.impl else ""
        out.append(f"{label}{mark}={sizes[label]}{impl}")
    return out


def site_record(site: Site, graph: Graph) -> dict[str, Any]:
    node = site.nodes[0]
    tensors = graph.trace.tensors
    paths = sorted({n.module_path for n in site.nodes})
    return {
        "location": f"{display_path(site.span.path)}:{site.span.line}:{site.span.col + 1}",
        "module_path": paths[0] if paths else "",
        "instances": len(site.nodes),
        "callee": site.callee,
        "layer": "".join(f"[{v}]" if v.isdigit() else f".{v}" for v in site.span.via),   # of an nn.Sequential
        "inputs": {name: list(tensors[tid].shape) for name, tid in
                   ((op.name, op.tid) for op in node.operands if op.tid is not None)},
        "outputs": [list(tensors[t].shape) for t in node.outputs],
        "dtypes": sorted({tensors[t].dtype.replace("torch.", "") for t in node.outputs}),
        "ops": len(node.ops),
        "annotation": site.rule.name if site.rule and site.dims is not None else None,
        "problem": site.problem,
        "splittable": _splittable(site),
    }


def inspect_json(graph: Graph) -> dict[str, Any]:
    summary = graph.summary()
    return {"summary": summary, "trace_mode": graph.trace.mode,
            "blocks": {k: len(v) for k, v in graph.blocks.items()},
            "sites": [site_record(s, graph) for s in graph.sites.values()]}


def inspect_table(graph: Graph) -> tuple[Group, str]:
    """One table per source file, titled by its package-relative path, rows by line:col: what
    fits 80 columns; a callee is never cut shorter than its whole name."""
    by_file: dict[str, list[Site]] = {}
    for site in graph.sites.values():
        by_file.setdefault(package_path(site.span.path), []).append(site)
    widest = max((len(_callee(site.callee)) for site in graph.sites.values()), default=6)
    tables = []
    for path, sites in by_file.items():
        # expand with ratios: the line and the callee take what they need, the rest share the width
        table = Table(header_style="bold", title=path, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                      collapse_padding=True, expand=True)
        table.add_column("line", no_wrap=True)      # what an editor follows: never broken
        table.add_column("module", overflow="fold", ratio=2)
        table.add_column("callee", no_wrap=True, min_width=min(widest, 32))
        for column, ratio in (("shapes", 3), ("annotation", 2), ("splittable dims", 3)):
            table.add_column(column, overflow="fold", ratio=ratio)
        for site in sites:
            record = site_record(site, graph)
            ins = " ".join(_shape(s) for s in record["inputs"].values())
            outs = " ".join(_shape(s) for s in record["outputs"])
            module = record["module_path"] + (f" ×{record['instances']}" if record["instances"] > 1 else "")
            annotation = record["annotation"] or f"[red]{record['problem']}[/red]"
            callee = _callee(site.callee) + (f" {record['layer']}" if record["layer"] else "")
            table.add_row(f"{site.span.line}:{site.span.col + 1}", module, callee, f"{ins} → {outs}", annotation,
                          " ".join(record["splittable"]))
        tables.append(table)
    summary = graph.summary()
    ops = max(summary["compute_ops"], 1)
    line = (f"{summary['sites']} sites, {summary['compute_ops']} compute ops: "
            f"{100 * summary['mapped'] / ops:.1f}% mapped to a source node, "
            f"{100 * summary['annotated'] / ops:.1f}% annotated; "
            f"{summary['block_kinds']} repeated block kind(s); traced with {graph.trace.mode} tensors")
    return Group(*tables), line
