"""The stateful PyTorch adapter of Opake: models, data loaders, files and the command line."""
