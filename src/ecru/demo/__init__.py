"""`ecru demo`: every pillar's quick demo on the bundled defaults, written up as one HTML report."""

from ecru.demo.report import DemoContext, Section, write_report
from ecru.demo.runner import SECTIONS, run_demo

__all__ = ["SECTIONS", "DemoContext", "Section", "run_demo", "write_report"]
