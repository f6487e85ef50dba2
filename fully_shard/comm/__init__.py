"""Collectives used by the library outside its forward/backward path."""
