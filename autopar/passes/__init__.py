"""Compiler passes, each a function from one plain value to the next (see DESIGN.md, "Data flow")."""
