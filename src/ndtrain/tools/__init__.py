"""The top floor: tools that read or drive what the lower floors produce (`ndtrain report`).
Nothing below imports from here."""
