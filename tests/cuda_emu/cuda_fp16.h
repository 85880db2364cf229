// Host stand-in for CUDA's cuda_fp16.h (tests/cuda_emu only): bits and conversions.
#pragma once
#include <cstring>
struct __half { unsigned short x; };
inline float __half2float(__half h) { _Float16 f; std::memcpy(&f, &h.x, 2); return (float)f; }
inline __half __float2half_rn(float v) { _Float16 f = (_Float16)v; __half h; std::memcpy(&h.x, &f, 2); return h; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline __half __double2half(double v) { return __float2half_rn((float)v); }  // emulation: via float
