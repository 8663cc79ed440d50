"""Ray Serve applications: `serve_apps.gpt:app` and its config file, config.yaml."""
