"""The toolkit version, in a leaf module so that any tier can record it without importing the package facade."""
__version__ = "0.1.0"
