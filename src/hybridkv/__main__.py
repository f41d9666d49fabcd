from hybridkv.cli import app

app()
