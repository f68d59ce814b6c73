"""Code that runs on the driver (and in the Ray Train controller): run preparation, the Ray
trainer, the metrics writer and its callback. Worker-side code lives in `raydl.train`."""
