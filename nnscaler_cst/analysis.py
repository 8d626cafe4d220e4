"""Stages 1-4a in one call: load the entry file, trace it, build the annotated graph."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import display_path
from .graph.graph import Graph, build_graph
from .graph.oprules import RuleSet, load_rules
from .lifetimes import objects_so_far_kept
from .source.entry import Entry, load_entry
from .report.progress import say
from .source.files import SourceSet
from .trace.records import Trace
from .trace.tracer import trace_model


@dataclass
class Analysis:
    entry: Entry
    sources: SourceSet
    trace: Trace
    graph: Graph
    rules: RuleSet


def analyze(model_file: str | Path, *, model_class: str | None = None, trace_mode: str = "auto",
            rules: RuleSet | None = None) -> Analysis:
    rules = rules or load_rules()
    sources = SourceSet()
    entry = load_entry(model_file, sources, model_class)
    trace = trace_model(entry, sources, library_modules=rules.library_modules, mode=trace_mode,
                        traced_modules=rules.traced_modules)
    say(f"probing the ops of {display_path(model_file)} for their split rules")
    with objects_so_far_kept():             # the trace lives on through the graph
        graph = build_graph(trace, rules, sources)
    graph.retrace = lambda slices: trace_model(entry, sources, library_modules=rules.library_modules, mode=trace.mode,
                                               traced_modules=rules.traced_modules,
                                               batch_slices=slices)
    return Analysis(entry, sources, trace, graph, rules)
