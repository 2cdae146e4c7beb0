# Sourced from the repository root by the H200 scripts (h200_control/run.sh, pays.sh, h200_mtp/run.sh):
# installs the GPU bundle (.gpu_bundle/) and soakd's dependency wheels (.gpu_wheels/) into /tmp/site once
# per machine, and sets the environment soakd runs in there. Returns 1 when the install fails.
if [[ ! -d /tmp/site/vllm ]]; then
  mkdir -p /tmp/bundle && cp .gpu_bundle/* /tmp/bundle/ && (cd /tmp/bundle && bash install.sh) || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_wheels/*.whl || return 1
fi
export PYTHONPATH=/tmp/site:$PWD/daemon VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
# soakd's optional C extensions (the sender's stream reader, daemon/soakd/engine/_reader.c; the prompt
# blocks, daemon/soakd/replay/_prompts.c), built in place where a C compiler and Python's headers are;
# else ones built for this Python elsewhere may be carried in; else soakd does their work in Python
# (engine.sender_reader = "auto"; numpy draws the prompt blocks, the same ids).
SUFFIX=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
for src in daemon/soakd/engine/_reader.c daemon/soakd/replay/_prompts.c; do
  if [[ ! -e "${src%.c}$SUFFIX" ]] && command -v cc > /dev/null; then
    cc -O2 -shared -fPIC -I"$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
      "$src" -o "${src%.c}$SUFFIX" 2> /dev/null || true
  fi
done
