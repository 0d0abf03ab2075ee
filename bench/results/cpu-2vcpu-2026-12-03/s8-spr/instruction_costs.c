#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define N 20000000L
#define R8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define A "imul $3, %0\n\t"
#define A10 A A A A A A A A A A
static double cyc;
static void clock_(){ long x=1; double t=now();
 for(long i=0;i<N;i++){ __asm__ volatile(A10 A10 A10 A10 A10 : "+r"(x)); }
 cyc = (now()-t)/(150.0*N); printf("cycle %.3f ns (%.2f GHz)\n", cyc*1e9, 1e-9/cyc); }
#define DECL(j) __m512 a##j = _mm512_set1_ps(j*1e-30f); __m512i p##j = _mm512_set1_epi32(j); __m512 f##j = _mm512_set1_ps(j);
#define REP(name, body) { double t=now(); for(long i=0;i<N;i++){ body; __asm__ volatile("" : "+v"(b), "+v"(c), "+v"(tab)); } \
   printf("%-28s %.2f cycles per iteration\n", name, (now()-t)/N/cyc); }
int main(){
  clock_();
  R8(DECL)
  __m512i b = _mm512_set1_epi32(0x3f803f80), c=_mm512_set1_epi32(0x3f803f81), tab=_mm512_set1_epi16(3);
#define DP(j) a##j=_mm512_dpbf16_ps(a##j,(__m512bh)b,(__m512bh)c);
#define FM(j) f##j=_mm512_fmadd_ps((__m512)b,(__m512)c,f##j);
#define PW(j) p##j=_mm512_permutexvar_epi16(p##j,tab);
#define SH(j) p##j=_mm512_srli_epi32(p##j,1);
#define PS(j) f##j=_mm512_permutexvar_ps(p##j,f##j);
  REP("8 dpbf16", R8(DP))
  REP("8 fma", R8(FM))
  REP("8 vpermw", R8(PW))
  REP("8 vpsrld", R8(SH))
  REP("8 vpermw + 8 dpbf16", R8(PW) R8(DP))
  REP("8 vpermw + 8 fma", R8(PW) R8(FM))
  REP("8 vpsrld + 8 fma", R8(SH) R8(FM))
  REP("8 vpsrld + 8 vpermw", R8(SH) R8(PW))
  REP("8 vpsrld+8 vpermw+8 dpbf16", R8(SH) R8(PW) R8(DP))
  __m512 s=a0;
#define SUM(j) s=_mm512_add_ps(s,a##j); s=_mm512_add_ps(s,f##j); s=_mm512_add_ps(s,_mm512_castsi512_ps(p##j));
  R8(SUM)
  printf("%f\n", _mm512_reduce_add_ps(s));
}
