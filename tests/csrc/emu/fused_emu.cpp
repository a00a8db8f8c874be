// The fused norm and gate bindings built with the CPU emulation of the device runtime (-DDS_EMU).
#include "ops/fused.cu"
#include "ops/fused_gate.cu"
