"""Helper scripts. A package (not a bare folder) so that `python -m scripts.device_check` finds this
folder first even on an image whose site-packages holds some other top-level `scripts` package."""
