"""Settings: every option declared once, for the CLI, the app and Python alike.

    config          PruneConfig: a run's settings, the presets, config.json and its older formats
    fields          type and range checks generic over a settings dataclass's annotated fields
    registry        what every registry shares (a name goes in once)"""
