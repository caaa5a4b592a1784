"""Sharding back-ends shared by the zero1, zero2 and fsdp methods."""
