"""``python -m pod`` runs the ``tpu-pod`` command line."""

from pod.cli import main

if __name__ == "__main__":
    main()
