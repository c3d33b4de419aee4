"""Toy registry entries, one module each, registered the documented way: one call at import."""
