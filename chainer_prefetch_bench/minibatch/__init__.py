"""The minibatch benchmark (the source paper, sec. 4.1): loaders side by side."""
