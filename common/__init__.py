"""Small pieces every layer shares (logging); imports nothing else of ReCoVer."""
