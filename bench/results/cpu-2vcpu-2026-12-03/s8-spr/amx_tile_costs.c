#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((aligned(64))) cfg_t;
int main(){
  syscall(SYS_arch_prctl, 0x1023, 18);
  cfg_t c; memset(&c,0,sizeof c); c.palette=1; for(int t=0;t<8;t++){c.rows[t]=16;c.colsb[t]=64;}
  _tile_loadconfig(&c);
  static uint16_t a[8][512] __attribute__((aligned(64))); static float out[256] __attribute__((aligned(64)));
  for(int i=0;i<8*512;i++) ((uint16_t*)a)[i]=0x3f80;
  long N=2000000; double t;
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  _tile_loadd(4,a[0],64);_tile_loadd(5,a[1],64);_tile_loadd(6,a[2],64);_tile_loadd(7,a[3],64);
  t=now(); for(long i=0;i<N;i++){ _tile_dpbf16ps(0,4,5);_tile_dpbf16ps(1,4,6);_tile_dpbf16ps(2,4,7);_tile_dpbf16ps(3,4,5);} 
  printf("tdp only (4 C): %.1f ns per tdp\n",(now()-t)/N/4*1e9);
  t=now(); for(long i=0;i<N;i++){ _tile_loadd(5,a[1],64);_tile_loadd(6,a[2],64);_tile_loadd(7,a[3],64);_tile_loadd(4,a[0],64);} 
  printf("tileloadd only: %.1f ns per load\n",(now()-t)/N/4*1e9);
  t=now(); for(long i=0;i<N;i++){ _tile_loadd(4,a[0],64); _tile_loadd(5,a[1],64);_tile_dpbf16ps(0,4,5);_tile_loadd(6,a[2],64);_tile_dpbf16ps(1,4,6);_tile_loadd(7,a[3],64);_tile_dpbf16ps(2,4,7);_tile_loadd(5,a[4],64);_tile_dpbf16ps(3,4,5);} 
  printf("load+tdp (as kernel): %.1f ns per tdp\n",(now()-t)/N/4*1e9);
  _tile_stored(0,out,64); printf("%f\n", out[0]);
  _tile_release();
}
