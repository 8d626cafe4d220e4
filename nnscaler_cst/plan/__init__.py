"""Stages 4b-5: plans as op-trans / op-assign / op-order, and the search that picks one."""
