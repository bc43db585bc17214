"""The output contract: column names and Arrow types (schema.py), the THD layout of a pack (thd.py),
the manifest (manifest.py) and the one reader of a packed output that every consumer uses."""
