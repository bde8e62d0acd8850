#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  MPI_Init(&argc,&argv); int r,p; MPI_Comm_rank(MPI_COMM_WORLD,&r); MPI_Comm_size(MPI_COMM_WORLD,&p);
  long sizes[]={1<<20,16<<20,64<<20}; int reps[]={50,10,5};
  for(int si=0;si<3;si++){
    long N=sizes[si]/4/p*p; long n=N/p;
    float*s=malloc(n*4),*rv=malloc(N*4);
    for(long i=0;i<n;i++) s[i]=(float)(i%97)*0.5f+r;
    int R=reps[si]; double t[3][64];
    for(int k=0;k<R;k++){
      for(int m=0;m<3;m++){
        MPI_Barrier(MPI_COMM_WORLD); double t0=MPI_Wtime();
        if(m==0) MPI_Allgather(s,n,MPI_FLOAT,rv,n,MPI_FLOAT,MPI_COMM_WORLD);
        else if(m==1){MPI_Request q; MPI_Iallgather(s,n,MPI_FLOAT,rv,n,MPI_FLOAT,MPI_COMM_WORLD,&q); int f=0; while(!f) MPI_Test(&q,&f,MPI_STATUS_IGNORE);}
        else { MPI_Request q[64]; int c=0;
          for(int j=1;j<p;j++){int from=(r-j+p)%p; MPI_Irecv(rv+from*n,n,MPI_FLOAT,from,7,MPI_COMM_WORLD,&q[c++]);}
          for(int j=1;j<p;j++){int to=(r+j)%p; MPI_Isend(s,n,MPI_FLOAT,to,7,MPI_COMM_WORLD,&q[c++]);}
          memcpy(rv+r*n,s,n*4);
          int f=0; while(!f) MPI_Testall(c,q,&f,MPI_STATUSES_IGNORE);
        }
        double dt=MPI_Wtime()-t0, mx; MPI_Reduce(&dt,&mx,1,MPI_DOUBLE,MPI_MAX,0,MPI_COMM_WORLD); t[m][k]=mx;
      }
    }
    if(r==0){printf("np %d %8ld B:",p,sizes[si]); const char*nm[]={"blocking","nonblock","direct"}; for(int m=0;m<3;m++){qsort(t[m],R,8,cmp); printf("  %s %.3f ms",nm[m],t[m][R/2]*1e3);} printf("\n");}
    free(s);free(rv);
  }
  MPI_Finalize();
}
