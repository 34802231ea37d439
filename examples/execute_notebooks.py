"""Execute the example notebooks and store their outputs, as the documentation shows them.

    python examples/execute_notebooks.py                      # every examples/*.ipynb
    python examples/execute_notebooks.py examples/dask_cluster.ipynb

Each notebook runs top to bottom on a fresh kernel of this interpreter (its environment's
packages, whatever kernelspecs are installed), in ``examples/``, through ``nbclient``;
the first failing cell stops it with the cell's error. Stream outputs are stored as a
Jupyter front end shows them: consecutive ones merged, and a line redrawn with carriage
returns (a progress bar) kept in its last state. The documentation renders the stored
outputs; the test suite executes the notebooks again, small, on both supported stacks
(``tests/integration/test_examples.py``).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def as_shown(text: str) -> str:
    """``text`` as a terminal or Jupyter shows it: each line from its last carriage return."""
    lines = text.replace("\r\n", "\n").split("\n")
    return "\n".join(line.rsplit("\r", 1)[-1] for line in lines)


def tidy_streams(nb) -> None:
    """Merge consecutive stream outputs of a cell and keep redrawn lines' last state."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        merged = []
        for out in cell.get("outputs", []):
            if (out.output_type == "stream" and merged and merged[-1].output_type == "stream"
                    and merged[-1].name == out.name):
                merged[-1].text += out.text
            else:
                merged.append(out)
        for out in merged:
            if out.output_type == "stream":
                out.text = as_shown(out.text)
        cell.outputs = merged


def execute(path: str, env: dict | None = None, timeout: int = 900):
    """Run the notebook at ``path`` on a fresh kernel of this interpreter, with ``env``
    (default: this process's environment); returns the executed notebook."""
    import nbclient
    import nbformat
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="python3")
    # The kernel is this interpreter, whatever kernelspecs exist.
    km.kernel_cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    client = nbclient.NotebookClient(nb, km=km, timeout=timeout,
                                     resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}})
    client.execute(env=dict(os.environ if env is None else env))
    return nb


def main(argv=None) -> int:
    import nbformat

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="*",
                   default=sorted(glob.glob(os.path.join(HERE, "*.ipynb"))))
    args = p.parse_args(argv)
    for path in args.notebooks:
        t0 = time.perf_counter()
        nb = execute(path)
        tidy_streams(nb)
        nbformat.write(nb, path)
        print(f"{path}: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
