"""The mlxkv command line (Typer). kvcore holds the library; this package only parses and renders."""
