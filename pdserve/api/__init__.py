"""Schemas shared by every component: cluster specs, wire types. The bottom layer."""
